"""What the engine asks for, as frozen values: the engine's only output.

The daemon executes them over MQTT (publishing, running the half's heavy calls in a worker thread
and feeding their results back as events); an in-process driver executes the same ones directly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedmq.fedcore.algorithms.base import Failure, NodeUpdate, RoundContext
from fedmq.fedcore.protocol import ReceiptStatus, SecAggDown
from fedmq.fedcore.secagg import RoundKey, SecAggSettings


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task: who gets it, its id (updates must quote it), and the model version it carries."""

    node: str
    task: bytes
    round: int
    """The round (sync) or the model version the task was built from (async): the header's round."""
    attempt: int
    """Sync: the round's attempt; async: how many tasks the node had before at this version. With
    the round it seeds the node's training stream, so that no two tasks of a node train alike."""
    version: int
    model: bytes | None = None
    """Sync: the attempt's public model id (`base.public_model_id`), which its model broadcast
    carries; `task` is the node's own (`base.node_task_id`). Async: None (no broadcast)."""


@dataclass(frozen=True, slots=True)
class Configure:
    """Call the half's `configure_round(ctx)` and prepare the model for `tasks` (then `Configured`)."""

    step: int
    ctx: RoundContext
    tasks: tuple[TaskSpec, ...]
    settings: Mapping[str, Any]
    """The training settings every task of this step carries (`TrainSettings.to_meta`)."""
    expiry_s: float
    """MQTT message expiry of the tasks and the model (each task also carries it as its deadline): a
    node that reconnects late does not train on a stale task. The engine's deadline (sync: the
    round's, async: a task's); the daemon publishes every frame of the step with it, even when it
    sends one again, rather than reading a deadline from the config, so the two cannot disagree."""
    inline_only: bool = False
    """Every task carries its model (async mode: tasks go out one by one, so there is no broadcast)."""
    keep_model: bool = False
    """Keep a copy of the model these tasks carry (version `ctx.version`) until an `Aggregate`'s
    `keep_from` passes it: an update will be read (a delta-compressed one is a difference from it) or
    folded (FedBuff adds each update's delta from it) against it. The engine decides (`keeps_models`);
    the half's calls (`coordinator.halfcalls`) keep what it says and derive nothing from the config."""


@dataclass(frozen=True, slots=True)
class SendTask:
    """Publish the task of `node` prepared for `step`."""

    step: int
    node: str


@dataclass(frozen=True, slots=True)
class Broadcast:
    """Publish `step`'s model once on the round's model topic (the broker fans it out)."""

    step: int
    round: int


@dataclass(frozen=True, slots=True)
class Resend:
    """Send `step`'s model to one node whose acknowledgement came after the broadcast."""

    step: int
    node: str


@dataclass(frozen=True, slots=True)
class Receipt:
    """Tell a node what became of its update (advisory: the metrics are the truth)."""

    node: str
    round: int
    task: bytes | None
    update_id: bytes
    status: ReceiptStatus
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Refused:
    """An update the engine refused: log why (it never goes further) and, when it broke the protocol
    (malformed, forged, duplicated, out of round), count it with the bus's rejections; a valid update
    that policy does not fold (late, stale, expired, after the end) is counted by the engine only."""

    node: str
    reason: str
    detail: str
    protocol: bool = True


@dataclass(frozen=True, slots=True)
class SecureSum:
    """What an `Aggregate` of a secure attempt (`engine.secure`) carries besides the masked updates: everything the
    unmasking (`fedcore.secagg.unmask`, run by the half's calls) needs, and nothing more."""

    settings: SecAggSettings
    key: RoundKey
    graph: Mapping[str, tuple[str, ...]]
    shared: frozenset[str]
    public_keys: Mapping[str, tuple[bytes, bytes]]
    commitments: Mapping[str, bytes]
    seed_shares: Mapping[str, Mapping[str, bytes]]
    """Per survivor, its self-mask seed's shares by revealer."""
    key_shares: Mapping[str, Mapping[str, bytes]]
    """Per node that shared and dropped, its mask key's shares by revealer."""
    weight_total: int
    """The sum of the participants' announced samples: each vector was weighted by n / weight_total."""


@dataclass(frozen=True, slots=True)
class Aggregate:
    """Call the half's `aggregate` (then `Aggregated`). With `bases`, fill `ctx.folding.bases` with
    those versions' models; kept versions below `keep_from` are no longer needed by anything (no task
    in flight, buffered update or update still to come, late ones included, was built from them) and
    are let go (None: nothing to let go)."""

    step: int
    ctx: RoundContext
    updates: Sequence[NodeUpdate]
    failures: Sequence[Failure]
    bases: tuple[int, ...] = ()
    keep_from: int | None = None
    secure: SecureSum | None = None
    """With secure aggregation, the `engine.secure.SecureSum` that unmasks the sum of `updates` (which
    are masked): the half then aggregates that sum as one update, never a node's own."""


@dataclass(frozen=True, slots=True)
class SendSecAgg:
    """Send one node a step of secure aggregation (`coordinator.engine.secure`), on its secagg topic."""

    node: str
    round: int
    message: SecAggDown


@dataclass(frozen=True, slots=True)
class Evaluate:
    """Evaluate the half's models on the test (and validation) set (then `Evaluated`)."""

    step: int


@dataclass(frozen=True, slots=True)
class Record:
    """One line of metrics.jsonl (a round attempt in sync mode, a model version in async mode)."""

    record: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Rollback:
    """Set the half back to its model from before step `step`'s aggregation: the engine rejected
    that model (its evaluation collapsed), so it is never published."""

    step: int
    reason: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Snapshot the half's model and state now, with `meta`, and write them in the background."""

    key: int
    meta: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PublishStatus:
    """The coordinator's retained status (every call) and state (when it changed)."""

    state: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Finish:
    """The run is over: `state` is finished, failed or stopped; `error` says why it failed."""

    state: str
    error: str = ""


@dataclass(frozen=True, slots=True)
class RoundEnded:
    """Hierarchical mode: a site round asked for by upstream closed, aggregated (its `Aggregate` made
    the partial update that goes upstream) or with nothing to send (no live node, no update in time)."""

    round: int
    attempt: int
    aggregated: bool
    accepted: int


Command = (
    Configure
    | SendTask
    | Broadcast
    | Resend
    | Receipt
    | Refused
    | Aggregate
    | SendSecAgg
    | Evaluate
    | Record
    | Rollback
    | Checkpoint
    | PublishStatus
    | Finish
    | RoundEnded
)
