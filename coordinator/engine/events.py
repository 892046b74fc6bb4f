"""What happens to the coordinator, as frozen values: the engine's only input.

The daemon turns MQTT messages, timers and the results of heavy calls (configure, aggregate,
evaluate, run in a worker thread) into these; an in-process driver makes the same ones without a
broker. Each carries only what the engine needs to decide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fedmq.broker import Message
from fedmq.fedcore.protocol import RunState

if TYPE_CHECKING:
    from fedmq.coordinator.updates import Ingested


@dataclass(frozen=True, slots=True)
class Start:
    """The run begins (after a resume, from the restored state)."""


@dataclass(frozen=True, slots=True)
class NodeSeen:
    """A node's liveness or announced sample count changed (its retained status, or its will when it died)."""

    node: str
    online: bool
    num_samples: int | None = None
    """The samples the node announced it holds (None: it announced none). Updates are weighted by the
    count they claim, which may not exceed this (`coordinator.updates.check_samples`); it reaches the
    engine as an event, not from the registry, so that the event log holds it and replays agree."""


@dataclass(frozen=True, slots=True)
class Acked:
    """A selected node subscribed to the round's model topic and says so."""

    node: str
    round: int
    task: bytes | None


@dataclass(frozen=True, slots=True)
class UpdateArrived:
    """An update (or a node's report that its training failed) passed the bus's checks: frame,
    federation, sender matching its topic. Everything about rounds and tensors is checked here."""

    message: Message
    received_at: float
    ingested: Ingested | None = field(default=None, compare=False)
    """The update read before the engine (`coordinator.updates.ingest`: the MQTT driver does it off the
    event loop for a large one); None: the engine reads it when it reaches it."""


@dataclass(frozen=True, slots=True)
class SecAggArrived:
    """A node's secure-aggregation message (`secagg-keys`, `secagg-shares` or `secagg-reveal`) passed
    the bus's checks; its meta is checked here (`fedcore.protocol`)."""

    message: Message
    received_at: float


@dataclass(frozen=True, slots=True)
class TaskUnsent:
    """Publishing a task failed: the node is treated as offline for that task."""

    node: str
    task: bytes


@dataclass(frozen=True, slots=True)
class Tick:
    """A timer the engine asked for (`next_deadline`) has come; the engine checks what is due."""


@dataclass(frozen=True, slots=True)
class Configured:
    """The half's `configure_round` for a `Configure` command is done and its model prepared.

    `inline`: the model rides in every task (no acknowledgement, no broadcast)."""

    step: int
    inline: bool


@dataclass(frozen=True, slots=True)
class Aggregated:
    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)
    model_sha256: str = ""
    """The new global model's hash (`fedcore.tensors.model_sha256`), for the event log; the engine ignores it."""
    rejected: str = ""
    """Why the model was not kept (NaN or inf in it): the half fell back to the last good one."""


@dataclass(frozen=True, slots=True)
class Evaluated:
    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Stop:
    """Stop now (SIGTERM, cancellation): the engine folds what it has accepted, then finishes."""

    reason: str = "stopped"


@dataclass(frozen=True, slots=True)
class RoundRequested:
    """Hierarchical mode, at a site aggregator: upstream sent it a task, so run one site round for it
    (`coordinator.engine.relay`)."""

    round: int
    attempt: int
    settings: Mapping[str, Any]
    """The upstream task's training settings (`TrainSettings.to_meta`), passed to the site's nodes as they are."""


@dataclass(frozen=True, slots=True)
class UpstreamFinished:
    """Hierarchical mode: the run upstream is over, so the site's run ends with it in `state`."""

    state: str = RunState.FINISHED


Event = (
    Start
    | NodeSeen
    | Acked
    | UpdateArrived
    | SecAggArrived
    | TaskUnsent
    | Tick
    | Configured
    | Aggregated
    | Evaluated
    | Stop
    | RoundRequested
    | UpstreamFinished
)

__all__ = [
    "Acked",
    "Aggregated",
    "Configured",
    "Evaluated",
    "Event",
    "NodeSeen",
    "RoundRequested",
    "SecAggArrived",
    "Start",
    "Stop",
    "TaskUnsent",
    "Tick",
    "UpdateArrived",
    "UpstreamFinished",
]


def describe(event: Any) -> str:
    """A short name for logs and event logs."""
    return type(event).__name__
