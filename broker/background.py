"""The background steps a daemon starts and nothing waits for (a publish, an announcement).

Each is kept until it ends and its failure is logged: an `asyncio` task nobody holds may be
collected mid-flight, and one nobody looks at fails silently. Both daemons keep theirs here, and
cancel what is left when they stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any


class Background:
    def __init__(self, log: logging.Logger | logging.LoggerAdapter[logging.Logger]) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Start `coro` in the background, kept until it ends."""
        task = asyncio.ensure_future(coro)
        if name is not None:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("%s failed: %r", task.get_name(), task.exception())

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    async def settle(self) -> None:
        """Wait until every step started so far has ended (not those started meanwhile: a daemon that
        stops waits for what it has, while messages may still come)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
