"""Refusal logging a flood cannot multiply (issue 31, item 6): a few lines per kind a minute, then a
count, summed up in one line when the kind comes back after its interval."""

from __future__ import annotations

import logging

import pytest

from fedmq.broker.throttle import MAX_KINDS, LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_one_kind_logs_its_burst_then_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    throttle = LogThrottle(logging.getLogger("t"), burst=3, interval_s=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t"):
        for i in range(40_000):  # the 40,000 frames of the report, in 20 s
            clock.now = i * 20 / 40_000
            throttle.warning(("bad-tensor", "updates/node-001"), "rejected %d", i)
        throttle.warning(("bad-header", "updates/node-002"), "another kind")  # its own burst
        clock.now = 61.0
        throttle.warning(("bad-tensor", "updates/node-001"), "rejected again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["rejected 0", "rejected 1", "rejected 2"] and lines[3] == "another kind"
    assert lines[4].startswith("39997 more like the above (('bad-tensor', 'updates/node-001'))")
    assert lines[5] == "rejected again" and len(lines) == 6


def test_distinct_kinds_beyond_the_bound_share_one(caplog: pytest.LogCaptureFixture) -> None:
    """A flood over 65,000 invented topics cannot grow the table (or the log) without bound."""
    throttle = LogThrottle(logging.getLogger("t2"), burst=1, interval_s=60, clock=Clock())
    with caplog.at_level(logging.WARNING, logger="t2"):
        for i in range(MAX_KINDS + 5000):
            throttle.warning(("bad", f"topic-{i}"), "line %d", i)
    assert len(throttle._windows) == MAX_KINDS + 1 and len(caplog.records) == MAX_KINDS + 1
