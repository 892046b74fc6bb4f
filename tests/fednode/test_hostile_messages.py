"""Issue 31 at the node: a refused task never costs the node its genuine one, and a coordinator run it
has not seen before hears its status again (its retained one may have been overwritten)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest

from fedmq.broker import Kind, Message, Topics
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.task import Task, TaskError
from tests.fednode.test_task_versions import _daemon, _task


def _pending(round: int = 4) -> Task:
    return Task(round, 0, os.urandom(16), Topics("f").model(round), TrainSettings(), 0.0)


async def test_an_inline_task_with_the_wrong_shapes_leaves_the_pending_task_in_place() -> None:
    """Under a malformed flood a task whose inline model had the wrong shapes replaced the node's
    genuine pending task before it was refused, so the node never trained its real one."""
    daemon = _daemon()
    genuine = daemon.tasks.pending = _pending()
    forged = _task(inline=True, payload={})
    forged = Message(
        kind=Kind.TASK, federation="f", round=4, sender="coordinator", meta=forged.meta,
        tensors={"model/w": np.zeros(3, np.float32)},
    )  # fmt: skip
    with pytest.raises(TaskError) as info:
        await daemon.tasks.on_task(forged)
    assert info.value.reason in ("wrong-shape", "bad-model", "missing-tensor", "unexpected-tensor")
    assert daemon.tasks.pending is genuine


class _Bus:
    connections = 1

    def __init__(self) -> None:
        self.published: list[tuple[str, Message, bool]] = []

    async def publish(self, topic: str, message: Message, *, retain: bool = False, **kw: Any) -> int:
        self.published.append((topic, message, retain))
        return 0


async def test_a_new_coordinator_run_hears_the_nodes_status_again() -> None:
    """64 random bytes retained on a node's status topic made a restarted coordinator never see it:
    the node announces itself again to each coordinator run it has not seen (once per run)."""
    daemon = _daemon()
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]

    def state(run_id: str, value: str = "waiting") -> Message:
        return Message(
            kind=Kind.COORDINATOR_STATUS, federation="f", round=-1, sender="coordinator",
            meta={"state": value, "run_id": run_id},
        )  # fmt: skip

    for message in (state("r1"), state("r1", "running"), state("r2"), state("r2", "running")):
        daemon._on_coordinator_status(message)
        await asyncio.sleep(0)
    async with asyncio.timeout(5):
        while len(bus.published) < 2 or len(daemon.background):
            await asyncio.sleep(0.01)
    assert [(t, m.meta["state"], r) for t, m, r in bus.published] == [
        (Topics("f").node_status("node-000"), "online", True)
    ] * 2
