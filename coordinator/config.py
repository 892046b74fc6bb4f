"""Settings of the coordinator daemon (composed by `experiments` from the experiment file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fedcore.compression import Compression
from fedcore.staleness import Staleness
from fedcore.training import TrainSettings

INLINE_MODEL_BYTES = 64 * 1024
"""The default `RoundPolicy.inline_model_bytes`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundPolicy:
    """When a round ends and what happens when too few updates came."""

    fraction: float = 0.1
    """C: each round samples max(1, floor(C x live nodes))."""
    over_selection: float = 1.0
    """Select ceil(factor x K) nodes and close the round as soon as K updates are accepted."""
    deadline_s: float = 60.0
    ack_timeout_s: float = 5.0
    """How long to wait for task acknowledgements before the one model broadcast goes out."""
    inline_model_bytes: int = INLINE_MODEL_BYTES
    """A model frame at most this large rides inside each selected node's task instead of one
    broadcast: the node's subscribe, acknowledgement and the wait for all of them are skipped (one
    broker round trip a round, and half the packets), at the price of K copies of the frame from
    the coordinator. 0 always broadcasts."""
    min_updates: int = 1
    on_insufficient: Literal["retry", "skip"] = "retry"
    max_retries: int = 3
    min_nodes: int = 1
    """Live nodes needed before the first round starts."""
    wait_for_nodes_s: float = 120.0
    receipts: Literal["all", "refusals"] = "all"
    """Tell a node what became of every update (all), or only of those not folded (refusals): a
    receipt is advisory, and at a thousand updates a second it is a third of the messages."""
    late_updates: Literal["drop", "carry"] = "drop"
    """An update that comes after its round closed: refused as late (drop), or validated and folded
    into the next aggregation with its staleness weight (carry; `AsyncPolicy.staleness`)."""
    max_node_samples: int | None = None
    """Refuse a node's announcement, or an update, claiming more samples than this (None: no limit).
    The count weights an update in the average, and until statuses are authenticated a node's
    announcement is as easy to forge as its update: this is the bound that holds regardless."""
    require_announced_samples: bool = True
    """Refuse updates from a node that announced no sample count ("samples-unannounced"): with no
    announcement to check it against, an update's weight would rest on that one message's word.
    False accepts them, bounded by max_node_samples only (for nodes that announce no count)."""

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"fraction {self.fraction} must be in (0, 1]")
        if self.over_selection < 1:
            raise ValueError("over_selection must be at least 1")
        if self.deadline_s <= 0 or self.ack_timeout_s <= 0 or self.wait_for_nodes_s <= 0:
            raise ValueError("deadline_s, ack_timeout_s and wait_for_nodes_s must be positive")
        if self.inline_model_bytes < 0:
            raise ValueError("inline_model_bytes must be non-negative (0: always broadcast)")
        if self.min_updates < 1 or self.min_nodes < 1 or self.max_retries < 0:
            raise ValueError("min_updates and min_nodes must be at least 1, max_retries non-negative")
        if self.on_insufficient not in ("retry", "skip"):
            raise ValueError("on_insufficient must be 'retry' or 'skip'")
        if self.receipts not in ("all", "refusals"):
            raise ValueError("receipts must be 'all' or 'refusals'")
        if self.late_updates not in ("drop", "carry"):
            raise ValueError("late_updates must be 'drop' or 'carry'")
        if self.max_node_samples is not None and self.max_node_samples < 1:
            raise ValueError("max_node_samples must be at least 1 (or None: no limit)")


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncPolicy:
    """Buffered asynchronous aggregation (FedAsync with buffer 1, FedBuff above): `engine.buffered`."""

    buffer: int = 10
    """K: fold every K accepted updates into a new model version."""
    concurrency: int = 20
    """Nodes training at once; a slot freed by a delivery is refilled at once."""
    max_staleness: int = 20
    """Updates trained from a version more than this many versions old are refused (recorded)."""
    staleness: Staleness = field(default_factory=Staleness)
    """The staleness weight s(tau) (also used for late updates carried in sync mode)."""
    server_lr: float = 1.0
    """FedBuff's server step eta_g; FedAsync's mixing weight is server_lr * s(tau)."""
    aggregations: int = 200
    """Model versions to produce: the asynchronous counterpart of rounds."""
    deadline_s: float = 60.0
    """A task not answered within this is lost and its slot refilled."""

    def __post_init__(self) -> None:
        if self.buffer < 1 or self.concurrency < 1 or self.aggregations < 1:
            raise ValueError("buffer, concurrency and aggregations must be at least 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be non-negative")
        if not (self.server_lr > 0 and self.deadline_s > 0):
            raise ValueError("server_lr and deadline_s must be positive")

    @property
    def rule(self) -> Literal["fedasync", "fedbuff"]:
        """K = 1 mixes each update into the model (FedAsync); K > 1 adds the buffer's mean delta (FedBuff)."""
        return "fedasync" if self.buffer == 1 else "fedbuff"


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    federation: str
    rounds: int
    seed: int = 0
    out_dir: Path = Path("runs/latest")
    policy: RoundPolicy = field(default_factory=RoundPolicy)
    train: TrainSettings = field(default_factory=TrainSettings)
    eval_every: int = 1
    method: str = "unknown"
    """For the summary only; the daemon never dispatches on it."""
    resume: bool = False
    eval_device: str = "cpu"
    """Where the test set is evaluated (a copy of the model goes there): "cuda" when the machine has one."""
    engine: Literal["sync", "async"] = "sync"
    """Synchronous rounds (`policy`) or buffered asynchronous aggregation (`asynchronous`)."""
    asynchronous: AsyncPolicy = field(default_factory=AsyncPolicy)
    compression: Compression = field(default_factory=Compression)
    """How the nodes compress their updates; an update compressed otherwise is refused (bad-compression)."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError("rounds must be at least 1")
        if self.eval_every < 1:
            raise ValueError("eval_every must be at least 1")
        if self.engine not in ("sync", "async"):
            raise ValueError("engine must be 'sync' or 'async'")
