"""The coordinator command's partition figure, drawn on a thread beside the start-up."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from fedmq.experiments.cli.coordinator import _drawn


def test_a_partition_figure_that_cannot_be_drawn_is_said_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The figure is drawn beside the coordinator's start-up and awaited at its end: a drawing that
    fails is a warning naming the file (partition.json holds the same histogram), not the run's end."""

    def fail() -> None:
        raise ValueError("histogram must be a non-empty nodes x classes array")

    async def run() -> None:
        await _drawn(asyncio.create_task(asyncio.to_thread(fail)), tmp_path / "partition.png")

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    assert "could not draw" in caplog.text and "partition.png" in caplog.text and "non-empty" in caplog.text
