"""Settings of one node daemon, the faults an experiment may inject into it, and its scenario script."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fedmq.fedcore.compression import Compression
from fedmq.fednode.scenario import NodeScript
from fedmq.fields import Bounds, check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class Faults:
    """Deterministic stragglers and crashes for experiments and tests."""

    delay_s: Annotated[float, Bounds(ge=0)] = 0.0
    """Extra compute time added after training, before the update is sent."""
    delay_rounds: frozenset[int] | None = None
    """Rounds the delay applies to; None means every round."""
    fail_at_round: Annotated[int | None, Bounds(ge=0)] = None
    """Crash (drop the connection without a goodbye, so the broker fires the will) on receiving this
    round's model, that is mid-round."""
    error_at_round: Annotated[int | None, Bounds(ge=0)] = None
    """Raise an error in this round's training (the node reports the failure and goes on)."""

    def __post_init__(self) -> None:
        check_fields(self)

    def delay_for(self, round: int) -> float:
        if self.delay_s and (self.delay_rounds is None or round in self.delay_rounds):
            return self.delay_s
        return 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    node_id: str
    federation: str
    seed: int = 0
    exit_when_done: bool = False
    """Exit once the coordinator this node worked for reports the run finished (experiments)."""
    announce_label_histogram: bool = False
    faults: Faults = field(default_factory=Faults)
    script: NodeScript = field(default_factory=NodeScript)
    """What the run's scenario scripts for this node (availability, modelled compute and link, drops);
    the default changes nothing. Played by `fednode.scripted`."""
    clock_skew_s: Annotated[float, Bounds(ge=0)] = 5.0
    """How far this machine's clock may run ahead of the coordinator's. A task counts as expired (and
    is not acted on) only once it is older, by its ``sent_at``, than its ``deadline_s`` plus this; a
    clock further ahead would make fresh tasks look expired, one behind lets stale ones through."""
    compression: Compression = field(default_factory=Compression)
    """How the node compresses its updates (`fedcore.compression`); the coordinator must expect the same."""

    def __post_init__(self) -> None:
        check_fields(self)
