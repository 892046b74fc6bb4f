"""The bookkeeping of one synchronous round attempt: who was asked, who answered, when it may close.

Pure state: the engine (`coordinator.engine.sync`) feeds it what happened and reads `done` and
`acks_complete`. A selected node counts as answered when its update was accepted or when it
reported a failed training; a node that went offline is not waited for either. A refused message
does not answer for a node: until the broker authenticates senders anyone can publish on a node's
topic, so the node's valid update is still taken until the round closes. A node that sent only
refused messages is waited for until the deadline (an honest node whose update diverged included)
and recorded as rejected at the close.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from fedmq.fedcore.tensors import TensorSpec


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    accepted: tuple[str, ...]
    late: tuple[str, ...]
    """Selected, still online, no update by the close."""
    lost: tuple[str, ...]
    """Selected, went offline before delivering."""
    rejected: tuple[str, ...]
    """Selected nodes from which only refused messages came (whether they went offline or not)."""
    carried: tuple[str, ...]
    """Updates accepted in an earlier attempt of the same round, still counted."""
    failed: tuple[str, ...] = ()
    """Selected nodes that reported their training failed."""


@dataclass(eq=False)
class RoundState:
    round: int
    attempt: int
    task_id: bytes
    """The attempt's secret (`SyncRounds` draws it): never sent; the node's task ids derive from it
    (`engine.base.node_task_id`)."""
    selected: tuple[str, ...]
    target: int
    """Updates (carried ones included) that close the round early."""
    schema: Mapping[str, Mapping[str, TensorSpec]]
    carried: dict[str, NodeUpdate] = field(default_factory=dict)
    started: float = 0.0
    """When the tasks went out, on the engine's clock: the deadline counts from here."""
    version: int = 0
    """The model version the tasks carry: updates must have trained from it."""
    task_sent_at: dict[str, float] = field(default_factory=dict)
    acked: set[str] = field(default_factory=set)
    accepted: dict[str, NodeUpdate] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    """The reason of each node's latest refused message; not an answer (see the module doc)."""
    failed: dict[str, str] = field(default_factory=dict)
    offline: set[str] = field(default_factory=set)
    model_published: bool = False
    closed: bool = False
    issued: frozenset[bytes] = frozenset()
    """The task ids sent in this attempt, one per selected node: an id among them that is not the
    sender's own is another node's (``foreign-task``)."""

    def __post_init__(self) -> None:
        # kept as nodes answer, so that each update costs O(1), not O(K), at K in the thousands
        self._selected = frozenset(self.selected)
        self._pending = set(self._selected) - self.accepted.keys() - self.failed.keys() - self.offline
        self._unacked = self._pending - self.acked

    @property
    def pending(self) -> set[str]:
        """Selected nodes that have not answered and are not offline."""
        return set(self._pending)

    def waiting_for(self, node_id: str) -> bool:
        """Whether `node_id` is selected and has neither answered nor gone offline (`pending`, no copy)."""
        return node_id in self._pending

    @property
    def updates(self) -> dict[str, NodeUpdate]:
        """Every update this round will aggregate: carried over and accepted now."""
        return self.carried | self.accepted

    def forget_tensors(self) -> None:
        """Once the attempt is over, keep who answered but not their tensors: a closed attempt is
        remembered only to recognise late and duplicate updates (the engine keeps 64 of them)."""
        self.accepted = {n: replace(u, payload=Payload()) for n, u in self.accepted.items()}
        self.carried = {n: replace(u, payload=Payload()) for n, u in self.carried.items()}

    def answered(self, node_id: str) -> bool:
        return node_id in self.accepted or node_id in self.failed

    def on_ack(self, node_id: str) -> None:
        self.acked.add(node_id)
        self._unacked.discard(node_id)

    def _answered_now(self, node_id: str) -> None:
        self._pending.discard(node_id)
        self._unacked.discard(node_id)

    def on_accepted(self, update: NodeUpdate) -> None:
        self.accepted[update.node_id] = update
        self._answered_now(update.node_id)

    def on_rejected(self, node_id: str, reason: str) -> None:
        """A message on the node's behalf was refused: noted, but the node may still answer."""
        self.rejected[node_id] = reason

    def on_failed(self, node_id: str, reason: str) -> None:
        """The node says its training failed: nothing will come, so the round does not wait for it."""
        self.failed[node_id] = reason
        self._answered_now(node_id)

    def on_offline(self, node_id: str) -> None:
        if node_id in self._selected and not self.answered(node_id):
            self.offline.add(node_id)
            self._answered_now(node_id)

    @property
    def acks_complete(self) -> bool:
        """Every selected node acknowledged, answered or left: the broadcast need wait no longer."""
        return not self._unacked

    @property
    def done(self) -> bool:
        """K updates are in (carried ones included, never asked again), or nobody is left to answer."""
        return len(self.carried) + len(self.accepted) >= self.target or not self._pending

    def close(self, is_live: Callable[[str], bool]) -> RoundOutcome:
        self.closed = True
        missing = [n for n in self.selected if not self.answered(n)]
        rejected = tuple(sorted(n for n in missing if n in self.rejected))
        silent = [n for n in missing if n not in self.rejected]
        lost = tuple(n for n in silent if n in self.offline or not is_live(n))
        late = tuple(n for n in silent if n not in lost)
        return RoundOutcome(
            accepted=tuple(sorted(self.accepted)),
            late=late,
            lost=lost,
            rejected=rejected,
            carried=tuple(sorted(self.carried)),
            failed=tuple(sorted(self.failed)),
        )
