"""Settings of the coordinator daemon (composed by `experiments` from the experiment file)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Literal

from fedmq.fedcore.compression import Compression
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.staleness import Staleness
from fedmq.fedcore.training import TrainSettings
from fedmq.fields import Bounds, check_fields

logger = logging.getLogger(__name__)

INLINE_MODEL_BYTES = 64 * 1024
"""The default `RoundPolicy.inline_model_bytes`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundPolicy:
    """When a round ends and what happens when too few updates came."""

    fraction: Annotated[float, Bounds(gt=0, le=1)] = 0.1
    """C: each round samples max(1, floor(C x live nodes))."""
    over_selection: Annotated[float, Bounds(ge=1)] = 1.0
    """Select ceil(factor x K) nodes and close the round as soon as K updates are accepted."""
    deadline_s: Annotated[float, Bounds(gt=0)] = 60.0
    """A round closes at its deadline with what arrived."""
    ack_timeout_s: Annotated[float, Bounds(gt=0)] = 5.0
    """How long to wait for task acknowledgements before the one model broadcast goes out."""
    inline_model_bytes: Annotated[int, Bounds(ge=0)] = INLINE_MODEL_BYTES
    """A model frame at most this large rides inside each selected node's task instead of one
    broadcast: the node's subscribe, acknowledgement and the wait for all of them are skipped (one
    broker round trip a round, and half the packets), at the price of K copies of the frame from
    the coordinator. 0 always broadcasts."""
    min_updates: Annotated[int, Bounds(ge=1)] = 1
    on_insufficient: Literal["retry", "skip"] = "retry"
    max_retries: Annotated[int, Bounds(ge=0)] = 3
    min_nodes: Annotated[int, Bounds(ge=1)] = 1
    """Live nodes needed before the first round starts."""
    wait_for_nodes_s: Annotated[float, Bounds(gt=0)] = 120.0
    late_updates: Literal["drop", "carry"] = "drop"
    """An update that comes after its round closed: refused as late (drop), or validated and folded
    into the next aggregation with its staleness weight (carry; `AsyncPolicy.staleness`)."""
    receipts: Literal["all", "refusals"] = "all"
    """Tell a node what became of every update (all), or only of those not folded (refusals): a
    receipt is advisory, and at a thousand updates a second it is a third of the messages."""
    max_node_samples: Annotated[int | None, Bounds(ge=1)] = None
    """Refuse a node's announcement, or an update, claiming more samples than this (None: no limit).
    The count weights an update in the average, and until statuses are authenticated a node's
    announcement is as easy to forge as its update: this is the bound that holds regardless."""
    require_announced_samples: bool = True
    """Refuse updates from a node that announced no sample count ("samples-unannounced"): with no
    announcement to check it against, an update's weight would rest on that one message's word.
    False accepts them, bounded by max_node_samples only (for nodes that announce no count)."""
    reject_below: Annotated[float | None, Bounds(gt=0, lt=1)] = None
    """Reject a round's model whose test accuracy falls below this share of the best so far (0.5:
    under half of it, as after a poisoned update): the coordinator keeps the last good model,
    names the round's updates as suspects and runs the round again (up to max_retries). A model
    holding NaN or inf is always rejected. None: accuracy rejects nothing (sync rounds only)."""
    exclude_after: Annotated[int | None, Bounds(ge=1)] = None
    """A node whose updates went into this many rejected models gets no more tasks (None: never)."""
    max_rounds_without_model: Annotated[int | None, Bounds(ge=1)] = 10
    """Fail the run, saying why, after this many rounds in a row end without a new model (too few
    updates after every retry, or a rejected model): a federation that cannot progress stops instead
    of waiting out deadline after deadline (issue 31); in async mode, folds in a row whose model
    was rejected (non-finite). None: never."""

    node_messages_per_s: Annotated[float | None, Bounds(gt=0)] = 50.0
    """Messages (statuses, acknowledgements, updates) the coordinator takes from one node a second,
    sustained, with room for node_message_burst at once; the rest are dropped before they reach the
    engine or the event log, and counted as ``over-budget`` (issue 31: a flood on a node's own topic
    filled the disk and slowed rounds 5 to 30 times). An honest node sends a few a round. None: no limit."""
    node_message_burst: Annotated[int, Bounds(ge=1)] = 500
    node_bytes_per_s: Annotated[int | None, Bounds(ge=1)] = None
    """Bytes the coordinator takes from one node a second, sustained, with room for four seconds' worth
    (and at least one transfer) at once; beyond them, dropped and counted as ``over-budget``. None: four
    of the largest transfers the bus takes a second (the bound an update's schema sets)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.ack_timeout_s >= self.deadline_s:
            self._shorten_ack_timeout()

    def _shorten_ack_timeout(self) -> None:
        """An ack timeout at or past the deadline: a broadcast round that selected a silent node
        would publish its model only when the round closes, and lose every update (issue 31).
        Adjusted, not refused: the ack wait only gathers subscriptions before the one broadcast (an
        acknowledgement after it gets the model on its own topic), and a small model rides in the
        tasks without any wait, so a short deadline is a valid setting; the wait becomes half of it."""
        adjusted = self.deadline_s / 2
        logger.warning(
            "policy.ack_timeout_s (%g s) is not below deadline_s (%g s): a round that selected a silent node"
            " would broadcast its model only at its deadline and lose every update; waiting %g s for"
            " acknowledgements instead (set ack_timeout_s below deadline_s to choose)",
            self.ack_timeout_s,
            self.deadline_s,
            adjusted,
        )
        object.__setattr__(self, "ack_timeout_s", adjusted)


@dataclass(frozen=True, kw_only=True, slots=True)
class AsyncPolicy:
    """Buffered asynchronous aggregation (FedAsync with buffer 1, FedBuff above): `engine.buffered`."""

    buffer: Annotated[int, Bounds(ge=1)] = 10
    """K: fold every K accepted updates into a new model version (1: FedAsync, above: FedBuff)."""
    concurrency: Annotated[int, Bounds(ge=1)] = 20
    """Nodes training at once; a slot freed by a delivery is refilled at once."""
    max_staleness: Annotated[int, Bounds(ge=0)] = 20
    """Updates trained from a version more than this many versions old are refused (recorded)."""
    staleness: Staleness = field(default_factory=Staleness)
    """The staleness weight s(tau) (also used for late updates carried in sync mode)."""
    server_lr: Annotated[float, Bounds(gt=0)] = 1.0
    """FedBuff's server step eta_g; FedAsync's mixing weight is server_lr * s(tau)."""
    aggregations: Annotated[int, Bounds(ge=1)] = 200
    """Model versions to produce: the asynchronous counterpart of rounds."""
    deadline_s: Annotated[float, Bounds(gt=0)] = 60.0
    """A task not answered within this is lost and its slot refilled."""

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def rule(self) -> Literal["fedasync", "fedbuff"]:
        """K = 1 mixes each update into the model (FedAsync); K > 1 adds the buffer's mean delta (FedBuff)."""
        return "fedasync" if self.buffer == 1 else "fedbuff"


@dataclass(frozen=True, kw_only=True, slots=True)
class CoordinatorConfig:
    federation: str
    rounds: Annotated[int, Bounds(ge=1)]
    """Synchronous rounds, or model versions of the asynchronous engine."""
    seed: int = 0
    out_dir: Path = Path("runs/latest")
    policy: RoundPolicy = field(default_factory=RoundPolicy)
    train: TrainSettings = field(default_factory=TrainSettings)
    eval_every: Annotated[int, Bounds(ge=1)] = 1
    """Evaluate every this many rounds (or model versions)."""
    eval_last: Annotated[int, Bounds(ge=0)] = 0
    """Evaluate after each of the last this many rounds (or versions) too: a metric over the last K rounds
    (FedSA's mean of the last 10) stays exact while `eval_every` spares the rounds before them."""
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
    nodes: frozenset[str] | None = None
    """The node ids of the experiment (`experiments.build` gives them): a status, acknowledgement or
    update from any other id is refused (``unknown-node``), so that no foreign id ever becomes a live
    node that rounds select and wait for (issue 31: 1,000 forged ids on an unsecured broker made every
    round wait its deadline). None admits any valid id."""
    node_samples: Mapping[str, int] | None = None
    """The most samples each node may announce (`experiments.build`: its shard of the experiment's
    partition, or a site's nodes' together): an announcement or update above it is refused as
    ``samples-over-limit``, so one node's credentials cannot buy the federation's weight by claiming
    10^11 samples (issue 31). A node not named is bounded by `policy.max_node_samples` only."""

    secure_aggregation: SecAggSettings | None = None
    """Secure aggregation (`fedcore.secagg`, `engine.secure`): the nodes mask their updates and the
    coordinator unmasks only their sum. None: updates are read in clear."""
    secure_timeout_s: Annotated[float, Bounds(gt=0)] = 30.0
    """How long each step of secure aggregation (keys, shares, reveals) waits for the nodes."""

    node_dp_delta: Annotated[float | None, Bounds(gt=0, lt=1)] = None
    """With node DP-SGD (``train.dp_noise_multiplier``), the delta each node's epsilon is reported for
    (`fedcore.privacy.NodePrivacy`); None: a tenth of 1 / the nodes."""

    def __post_init__(self) -> None:
        check_fields(self)
        secure = self.secure_aggregation
        if secure is not None and secure.l2_clip is not None and secure.fixed_total is None:
            raise ValueError(
                "secure_aggregation.l2_clip (central DP) needs fixed_total, the cohort each node divides by"
            )
        if self.nodes is not None:
            object.__setattr__(self, "nodes", frozenset(self.nodes))
        if self.node_samples is not None:
            object.__setattr__(self, "node_samples", MappingProxyType(dict(self.node_samples)))

    def sample_limit(self, node: str) -> int | None:
        """The most samples `node` may announce or claim: the tighter of its own bound and the policy's."""
        own = self.node_samples.get(node) if self.node_samples is not None else None
        limits = [x for x in (own, self.policy.max_node_samples) if x is not None]
        return min(limits) if limits else None
