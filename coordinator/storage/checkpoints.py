"""Checkpoints written beside the rounds, not between them.

A checkpoint is two files made durable with fsync (the model and algorithm state, and
participation.json), which took 8 ms a file here and up to 46 ms: more than a whole round of a small
federation costs otherwise (``fedmq bench rounds``). So the round ends with a snapshot (copies of
the tensors and the record, taken while nothing changes them) and one background writer writes
snapshots in order; when rounds outpace the disk, a waiting snapshot is replaced by the newer one
(only the latest is ever read back). `flush` waits for the latest to be on disk: the daemon calls
it before it exits, so a stopped run always resumes from its last round. A crash loses at most
the rounds whose snapshot was still being written; `--resume` then runs them again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

Write = Callable[[], None]
"""Writes one snapshot; runs in a worker thread."""


class CheckpointWriter:
    def __init__(self) -> None:
        self._pending: tuple[int, Write] | None = None
        self._task: asyncio.Task[None] | None = None
        self.written_round = -1
        """The last round whose checkpoint is on disk."""
        self.replaced = 0
        """Snapshots dropped because a newer one came before they were written."""
        self.failures = 0

    def submit(self, round: int, write: Write) -> None:
        """Write `write`'s snapshot of `round` as soon as the writer is free (newest first in line)."""
        if self._pending is not None:
            self.replaced += 1
        self._pending = (round, write)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="checkpoint-writer")

    async def _drain(self) -> None:
        while self._pending is not None:
            round, write = self._pending
            self._pending = None
            try:
                await asyncio.to_thread(write)
            except Exception:  # a full disk must not stop the federation; the log says why, loudly
                self.failures += 1
                logger.exception("checkpoint of round %d could not be written", round)
            else:
                self.written_round = round

    async def flush(self) -> None:
        """Wait until the latest submitted snapshot is written (or failed)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)
