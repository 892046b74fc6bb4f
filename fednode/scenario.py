"""What a scenario scripts for one node, as plain values: when it is online, how fast it computes and
talks, and which of its tasks it drops.

The experiments package reads scenario files and expands them (seeded) into one `NodeScript` per
node; the node daemon plays it in wall time and the in-process simulation in virtual time, so a
scenario means the same in both. Times are seconds from the run's start (the moment the node
daemon starts serving, or virtual time 0).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from fedmq.fedcore.seeding import stream


@dataclass(frozen=True, slots=True)
class Transition:
    """The node comes online or goes offline at `at`. A crash goes offline without a goodbye: the
    work in hand is lost (on the bus the broker's will says so; here the node drops its task)."""

    at: float
    online: bool
    crash: bool = False


@dataclass(frozen=True, slots=True)
class NodeScript:
    """One node's scripted behaviour; the default script changes nothing."""

    transitions: tuple[Transition, ...] = ()
    """Sorted by time; the node's state before the first is `starts_online`."""
    starts_online: bool = True
    compute_factor: float = 1.0
    """Multiplies the modelled compute time (10 = ten times slower than the scenario's base)."""
    task_s: float = 0.0
    """Modelled compute time of one task at factor 1, before `per_sample_s`."""
    per_sample_s: float = 0.0
    """Modelled compute time per training sample of the node's shard, at factor 1."""
    latency_s: float = 0.0
    """One-way link latency, added to what the node receives and to what it sends."""
    bandwidth_bps: float | None = None
    """Link bandwidth in bytes per second, each way; None: unlimited."""
    drop_p: float = 0.0
    """Probability that the node silently drops a task it received (decided per task, seeded)."""
    seed: int = 0
    _times: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        times = tuple(t.at for t in self.transitions)
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError("transitions must be sorted by time")
        if any(t < 0 or not math.isfinite(t) for t in times):
            raise ValueError("transition times must be finite and non-negative")
        for name in ("compute_factor", "task_s", "per_sample_s", "latency_s"):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be finite and non-negative, got {value}")
        if self.compute_factor == 0:
            raise ValueError("compute_factor must be positive")
        if self.bandwidth_bps is not None and not self.bandwidth_bps > 0:
            raise ValueError(f"bandwidth_bps must be positive, got {self.bandwidth_bps}")
        if not 0 <= self.drop_p <= 1:
            raise ValueError(f"drop_p must be in [0, 1], got {self.drop_p}")
        object.__setattr__(self, "_times", times)

    @property
    def scripted(self) -> bool:
        """Whether the script changes anything at all."""
        return self != NodeScript(seed=self.seed)

    def compute_s(self, num_samples: int) -> float:
        """The modelled compute time of one task (0 when the scenario models none)."""
        return (self.task_s + self.per_sample_s * num_samples) * self.compute_factor

    def transfer_s(self, nbytes: int) -> float:
        """Time for `nbytes` to cross the node's link one way."""
        if self.bandwidth_bps is None:
            return self.latency_s
        return self.latency_s + nbytes / self.bandwidth_bps

    def drops(self, node_id: str, k: int) -> bool:
        """Whether the node drops its `k`-th task (0-based, counted over the run)."""
        if self.drop_p <= 0:
            return False
        if self.drop_p >= 1:
            return True
        return bool(stream(self.seed, "scenario-drop", node_id, k).random() < self.drop_p)

    def online_at(self, t: float) -> bool:
        i = bisect.bisect_right(self._times, t)
        return self.starts_online if i == 0 else self.transitions[i - 1].online
