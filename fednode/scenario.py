"""What a scenario scripts for one node, as plain values: when it is online, how fast it computes and
talks, which of its tasks it drops, and the faults an experiment injects by round.

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
from typing import Annotated

from fedmq.fedcore.seeding import stream
from fedmq.fields import Bounds, check_fields


@dataclass(frozen=True, slots=True)
class Transition:
    """The node comes online or goes offline at `at`. A crash goes offline without a goodbye: the
    work in hand is lost (on the bus the broker's will says so; here the node drops its task)."""

    at: float
    online: bool
    crash: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Faults:
    """Deterministic stragglers and crashes, by round, for experiments and tests: the part of a node's
    script that an experiment file's `faults:` section writes (`experiments.build.node_scripts`)."""

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
    faults: Faults = field(default_factory=Faults)
    """Injected by round (the experiment file's `faults:`): a delay before the update, a crash, an error."""
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
