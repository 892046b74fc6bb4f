"""The background checkpoint writer: in order, newest wins while busy, flush waits, failures survive."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fedmq.coordinator.storage.checkpoints import CheckpointWriter

pytestmark = pytest.mark.timed  # the writer's thread, waited with timeouts: never in the compute lane (conftest)


async def test_writes_in_order_and_replaces_a_waiting_snapshot_by_a_newer_one() -> None:
    """While round 0 is being written, rounds 1 and 2 arrive: 1 is replaced by 2, never written."""
    writer = CheckpointWriter()
    started, release = threading.Event(), threading.Event()
    written: list[int] = []

    def write(round: int, block: bool = False) -> None:
        if block:
            started.set()
            assert release.wait(10)
        written.append(round)

    writer.submit(0, lambda: write(0, block=True))
    assert await asyncio.to_thread(started.wait, 10)  # the writer has started round 0
    writer.submit(1, lambda: write(1))
    writer.submit(2, lambda: write(2))
    release.set()
    await writer.flush()
    assert written == [0, 2] and writer.written_round == 2 and writer.replaced == 1


async def test_flush_waits_for_the_latest_and_returns_at_once_when_idle() -> None:
    writer = CheckpointWriter()
    await writer.flush()
    done = threading.Event()
    writer.submit(7, lambda: (threading.Event().wait(0.1), done.set()))
    await writer.flush()
    assert done.is_set() and writer.written_round == 7


async def test_a_failed_write_is_logged_and_the_next_one_still_happens(caplog: pytest.LogCaptureFixture) -> None:
    writer = CheckpointWriter()

    def fail() -> None:
        raise OSError("No space left on device")

    writer.submit(3, fail)
    await writer.flush()
    writer.submit(4, lambda: None)
    await writer.flush()
    assert writer.failures == 1 and writer.written_round == 4
    assert "checkpoint of round 3 could not be written" in caplog.text and "No space left" in caplog.text
