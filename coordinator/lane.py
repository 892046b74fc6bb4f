"""The algorithm half's heavy calls, one at a time on one worker thread, in the order asked.

One long-lived thread and a queue instead of `asyncio.to_thread` per call: at a thousand updates a
second the executor's futures, tasks and wake-ups cost more than a small model's configure or
aggregate. Results come back to the event loop with `call_soon_threadsafe`; the half is never
called from two threads at once, so it sees its model whole.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

Done = Callable[[Any, BaseException | None], None]
"""Called on the event loop with (result, None) or (None, exception)."""


class Lane:
    def __init__(self, name: str = "coordinator-lane") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Done] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = 0
        self._idle: asyncio.Event | None = None

    def submit(self, call: Callable[[], Any], done: Done) -> None:
        """Run `call` after everything submitted before it; `done` gets its outcome on the loop."""
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._idle = asyncio.Event()
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()
        assert self._idle is not None
        self._pending += 1
        self._idle.clear()
        self._queue.put((call, done))

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            call, done = item
            try:
                result, error = call(), None
            except BaseException as exc:  # handed to `done`, which decides what it means
                result, error = None, exc
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._finish, done, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return

    def _finish(self, done: Done, result: Any, error: BaseException | None) -> None:
        self._pending -= 1
        try:
            done(result, error)
        finally:
            if self._pending == 0 and self._idle is not None:
                self._idle.set()

    async def drain(self) -> None:
        """Wait until every submitted call has run and reported."""
        if self._idle is not None and self._pending:
            await self._idle.wait()

    def close(self) -> None:
        """Let the thread end once the queue is empty (it is a daemon thread either way)."""
        if self._thread is not None:
            self._queue.put(None)
