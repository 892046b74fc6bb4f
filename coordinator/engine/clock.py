"""Time for the engine: passed in, never read behind its back, so tests and simulations control it."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""
        ...


class MonotonicClock:
    """The daemon's clock: `time.monotonic`."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told: engine tests in milliseconds, simulations in virtual time."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"time does not go backwards ({seconds} s)")
        self._now += seconds
        return self._now

    def set(self, now: float) -> float:
        """Jump to `now` (not before the present)."""
        return self.advance(now - self._now)
