"""The participation record: per node, when and how often its updates were accepted.

The coordinator writes it (selection, acceptance, late and lost updates); strategies read it. KDIA's
teacher weights come from it (last accepted round, count, data size). Only an accepted update counts
as participation: a node that was selected and delivered nothing keeps its previous record.

"Round" is the round number in sync mode. In async mode it is the index of the model version an
accepted update is folded into (0, 1, 2, ...): the engine records each folded update at that
index, so ``last_round`` is the last version a node's update went into and the intervals count
versions between a node's participations. KDIA's triFreqs teacher (interval, count, data size) is
thus defined in both modes. One node may have two updates folded into the same version (it
delivered, got a new task at that version and delivered again before the buffer was folded): both
count as participations, and the repeat adds no interval (0 is not a gap between participations).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

MAX_INTERVALS = 64


@dataclass(slots=True)
class NodeParticipation:
    node_id: str
    num_samples: int = 0
    last_round: int = -1
    """Last round (async: model version index) whose update was accepted; -1 before any."""
    count: int = 0
    """Accepted participations (async: two updates folded into one version count twice)."""
    rounds_selected: int = 0
    late: int = 0
    lost: int = 0
    rejected: int = 0
    failed: int = 0
    """Rounds whose training the node reported as failed."""
    last_selected_round: int = -1
    intervals: list[int] = field(default_factory=list)
    """Rounds (async: versions) between consecutive accepted participations, the most recent
    MAX_INTERVALS; a repeat in the same round adds none."""
    interval_sum: int = 0
    interval_count: int = 0
    last_rtt_s: float | None = None
    """Seconds from publishing the task to receiving the update, for the last accepted update."""
    last_train_s: float | None = None

    @property
    def mean_interval(self) -> float | None:
        return self.interval_sum / self.interval_count if self.interval_count else None

    def to_json(self) -> dict[str, Any]:
        # every field by name, not dataclasses.asdict: a checkpoint holds thousands of these each round
        data = {name: getattr(self, name) for name in _NAMES}
        data["intervals"] = list(self.intervals)
        data["mean_interval"] = self.mean_interval
        return data


_NAMES = tuple(f.name for f in fields(NodeParticipation))
_FIELDS = set(_NAMES)


class ParticipationRecord:
    """All nodes' records; vectorised views for strategies that weigh thousands of nodes."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeParticipation] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __iter__(self) -> Iterator[NodeParticipation]:
        return iter(self._nodes.values())

    def get(self, node_id: str) -> NodeParticipation | None:
        return self._nodes.get(node_id)

    def ensure(self, node_id: str, *, num_samples: int | None = None) -> NodeParticipation:
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeParticipation(node_id)
        if num_samples is not None:
            node.num_samples = int(num_samples)
        return node

    def selected(self, node_ids: Iterable[str], round: int) -> None:
        for node_id in node_ids:
            node = self.ensure(node_id)
            node.rounds_selected += 1
            node.last_selected_round = round

    def accepted(
        self, node_id: str, round: int, *, num_samples: int, rtt_s: float | None = None, train_s: float | None = None
    ) -> None:
        """Record an accepted update of `node_id` in `round` (async: the version index it is folded
        into). A second update in the node's last round counts once more without an interval; an
        earlier round than its last is a ValueError."""
        node = self.ensure(node_id, num_samples=num_samples)
        if round < node.last_round:
            raise ValueError(f"node {node_id}: round {round} accepted after round {node.last_round}")
        if node.last_round >= 0 and round > node.last_round:
            gap = round - node.last_round
            node.intervals.append(gap)
            del node.intervals[:-MAX_INTERVALS]
            node.interval_sum += gap
            node.interval_count += 1
        node.last_round = round
        node.count += 1
        node.last_rtt_s = rtt_s
        node.last_train_s = train_s

    def late(self, node_id: str) -> None:
        self.ensure(node_id).late += 1

    def lost(self, node_id: str) -> None:
        self.ensure(node_id).lost += 1

    def rejected(self, node_id: str) -> None:
        self.ensure(node_id).rejected += 1

    def failed(self, node_id: str) -> None:
        self.ensure(node_id).failed += 1

    def arrays(self, node_ids: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """``last_round``, ``count`` and ``num_samples`` as aligned arrays (plus ``node_ids``)."""
        ids = sorted(self._nodes) if node_ids is None else list(node_ids)
        nodes = [self._nodes.get(i) or NodeParticipation(i) for i in ids]
        return {
            "node_ids": np.array(ids, dtype=object),
            "last_round": np.array([n.last_round for n in nodes], dtype=np.int64),
            "count": np.array([n.count for n in nodes], dtype=np.int64),
            "num_samples": np.array([n.num_samples for n in nodes], dtype=np.int64),
        }

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {node_id: self._nodes[node_id].to_json() for node_id in sorted(self._nodes)}

    @classmethod
    def from_json(cls, data: dict[str, dict[str, Any]]) -> ParticipationRecord:
        """Rebuild from `to_json` output (a checkpoint); raises ValueError on anything else."""
        record = cls()
        if not isinstance(data, dict):
            raise ValueError("participation record must be a map of node id to record")
        for node_id, entry in data.items():
            if not isinstance(entry, dict) or entry.get("node_id") != node_id:
                raise ValueError(f"participation entry for {node_id!r} is malformed")
            values = {k: v for k, v in entry.items() if k in _FIELDS}
            try:
                record._nodes[node_id] = NodeParticipation(**values)
            except TypeError as exc:
                raise ValueError(f"participation entry for {node_id!r}: {exc}") from exc
        return record
