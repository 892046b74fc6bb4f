"""What one node's traffic may cost the coordinator: a message and a byte budget per node.

Issue 31, item 6: 40,000 small frames on one node's own topic in 20 s each went through validation,
the event log (16.9 MB) and the log, and slowed six rounds 5 to 30 times; nothing limited the rate.
Every node now has two token buckets, refilled continuously: messages beyond its message budget, or
bytes beyond its byte budget, are dropped before they become events (so they cost neither the engine
nor the event log), counted as ``over-budget`` and summed up in the log a few lines a minute.

An honest node sends a handful of messages a round (its status, an acknowledgement, an update), far
below the defaults; only a node that floods its own topics (or a client forging them on an unsecured
broker) meets the limit, and then only its own messages are dropped. A token bucket is written here
rather than taken from a rate-limiting library because the decision must take an injected clock (the
tests) and a bounded table (a flood of invented node ids), and it is ten lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fedmq.coordinator.config import RoundPolicy

MAX_NODES_TRACKED = 65_536
"""Buckets kept at once; beyond this, the buckets that have refilled to full are forgotten (a full
bucket and a new one are the same), so a flood of invented node ids cannot grow the table."""


@dataclass
class _Bucket:
    tokens: float
    updated: float

    def refill(self, rate: Rate, now: float) -> float:
        """The tokens now: what was left plus what the time since the last refill gave, up to the burst."""
        self.tokens = min(rate.burst, self.tokens + (now - self.updated) * rate.per_s)
        self.updated = now
        return self.tokens


@dataclass(frozen=True, slots=True)
class Rate:
    """So many units a second, with room for `burst` at once."""

    per_s: float
    burst: float


class NodeBudgets:
    """Per node, whether its next message fits its message and byte budgets (`admit`)."""

    def __init__(
        self, messages: Rate | None, byte_rate: Rate | None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.messages, self.bytes, self._clock = messages, byte_rate, clock
        self._buckets: dict[str, tuple[_Bucket, _Bucket]] = {}

    def admit(self, node: str, size: int) -> str | None:
        """None if a message of `size` bytes from `node` fits its budgets (and is charged to them);
        otherwise which budget it exceeds ("messages" or "bytes"), and nothing is charged."""
        if self.messages is None and self.bytes is None:
            return None
        now = self._clock()
        buckets = self._buckets.get(node)
        if buckets is None:
            if len(self._buckets) >= MAX_NODES_TRACKED:
                self._forget_full(now)
            buckets = self._buckets[node] = (self._new(self.messages, now), self._new(self.bytes, now))
        count, volume = buckets
        if self.bytes is not None and size > self.bytes.burst:
            return "bytes"  # could never fit, however long it waited
        # both checked before either is charged, so that a refused message costs its node nothing
        if self.messages is not None and count.refill(self.messages, now) < 1:
            return "messages"
        if self.bytes is not None and volume.refill(self.bytes, now) < size:
            return "bytes"
        if self.messages is not None:
            count.tokens -= 1
        if self.bytes is not None:
            volume.tokens -= size
        return None

    @staticmethod
    def _new(rate: Rate | None, now: float) -> _Bucket:
        return _Bucket(tokens=rate.burst if rate is not None else 0.0, updated=now)

    def _forget_full(self, now: float) -> None:
        for node, (count, volume) in list(self._buckets.items()):
            if all(rate is None or bucket.refill(rate, now) >= rate.burst
                   for rate, bucket in ((self.messages, count), (self.bytes, volume))):  # fmt: skip
                del self._buckets[node]
        if len(self._buckets) >= MAX_NODES_TRACKED:  # every one of them busy: a flood of ids; start over
            self._buckets.clear()


def node_budgets(policy: RoundPolicy, max_transfer_bytes: int) -> NodeBudgets:
    """The budgets `policy` sets, the byte budget's default from the largest transfer the bus takes
    (`experiments.build.update_sized` bounds it by the update's schema): four such a second, and the
    burst four seconds' worth, so that no message the bus would take can exceed the burst alone."""
    messages = None
    if policy.node_messages_per_s is not None:
        messages = Rate(per_s=policy.node_messages_per_s, burst=policy.node_message_burst)
    per_s = policy.node_bytes_per_s if policy.node_bytes_per_s is not None else 4 * max_transfer_bytes
    return NodeBudgets(messages, Rate(per_s=per_s, burst=max(4 * per_s, max_transfer_bytes)))
