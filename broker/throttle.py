"""Log lines that a flood cannot multiply: the first few of a kind per interval are logged as they
come, the rest are counted and summed up in one line when the interval turns (issue 31: 40,000
refused frames in 20 s wrote 11 MB of log, one WARNING each, about 2.5 GB an hour)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

MAX_KINDS = 1024
"""Kinds tracked at once; beyond this, new kinds share one (a flood of distinct topics stays bounded)."""


@dataclass
class _Window:
    started: float
    logged: int = 0
    suppressed: int = 0


class LogThrottle:
    """Per kind (say, a refusal's reason and topic): `burst` lines per `interval_s`, then a count."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 5,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.burst, self.interval_s, self._clock = logger, burst, interval_s, clock
        self._windows: dict[Hashable, _Window] = {}

    def warning(self, kind: Hashable, message: str, *args: object) -> None:
        """Log `message % args` at WARNING unless this kind has had its `burst` in the current interval."""
        now = self._clock()
        if kind not in self._windows and len(self._windows) >= MAX_KINDS:
            self._flush(now)
            kind = "(other kinds)" if len(self._windows) >= MAX_KINDS else kind
        window = self._windows.get(kind)
        if window is not None and now - window.started >= self.interval_s:
            self._summarise(kind, window)
            window = None
        if window is None:
            window = self._windows[kind] = _Window(started=now)
        if window.logged < self.burst:
            window.logged += 1
            self.logger.warning(message, *args)
        else:
            window.suppressed += 1

    def _flush(self, now: float) -> None:
        """Summarise and forget the kinds whose interval is over."""
        for kind, window in list(self._windows.items()):
            if now - window.started >= self.interval_s:
                self._summarise(kind, window)
                del self._windows[kind]

    def _summarise(self, kind: Hashable, window: _Window) -> None:
        if window.suppressed:
            self.logger.warning(
                "%d more like the above (%s) in %g s were not logged one by one",
                window.suppressed,
                kind,
                self.interval_s,
            )
