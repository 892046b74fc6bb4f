"""Settings of one node daemon, with its scenario script (which holds the faults an experiment injects)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fedmq.fedcore.compression import Compression
from fedmq.fednode.scenario import NodeScript
from fedmq.fields import Bounds, check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeConfig:
    node_id: str
    federation: str
    seed: int = 0
    exit_when_done: bool = False
    """Exit once the coordinator this node worked for reports the run finished (experiments)."""
    announce_label_histogram: bool = False
    script: NodeScript = field(default_factory=NodeScript)
    """What the run's scenario scripts for this node (availability, modelled compute and link, drops,
    injected faults); the default changes nothing. Played by `fednode.scripted`."""
    clock_skew_s: Annotated[float, Bounds(ge=0)] = 5.0
    """How far this machine's clock may run ahead of the coordinator's. A task counts as expired (and
    is not acted on) only once it is older, by its ``sent_at``, than its ``deadline_s`` plus this; a
    clock further ahead would make fresh tasks look expired, one behind lets stale ones through."""
    compression: Compression = field(default_factory=Compression)
    """How the node compresses its updates (`fedcore.compression`); the coordinator must expect the same."""

    def __post_init__(self) -> None:
        check_fields(self)
