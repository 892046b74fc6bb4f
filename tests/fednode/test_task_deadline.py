"""The node daemon does not act on a task whose deadline passed before it arrived (``sent_at`` +
``deadline_s``, with `NodeConfig.clock_skew_s` for the machines' clocks), nor on one for another
method than its own (the task's method fingerprint), and answers a fresh one of its own method."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

import pytest
import torch

from fedmq.broker import BusConfig, Kind, Message, Topics
from fedmq.fedcore.algorithms.fedavg import Hyperparams, NodeHalf
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.tensors import flatten_groups
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.task import TaskError
from fedmq.fednode.workspace import Workspace


class _Bus:
    """Records what the daemon publishes and subscribes to (the part of a BusClient tasks use)."""

    def __init__(self) -> None:
        self.published: list[Message] = []
        self.frames: list[bytearray] = []
        self.subscribed: list[str] = []
        self.stats = type("Stats", (), {"rejected": Counter()})()

    async def publish_frame(self, topic: str, frame: bytearray, *, round: int) -> None:
        self.frames.append(frame)

    async def publish(self, topic: str, message: Message, **kwargs: Any) -> None:
        self.published.append(message)

    async def subscribe(self, *topics: str) -> None:
        self.subscribed += topics

    async def unsubscribe(self, *topics: str) -> None:
        pass


def _daemon(clock_skew_s: float = 5.0) -> tuple[NodeDaemon, _Bus]:
    data = TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long), 2)
    daemon = NodeDaemon(
        NodeConfig(node_id="node-000", federation="f", clock_skew_s=clock_skew_s),
        BusConfig.from_url("mqtt://127.0.0.1:1"),
        NodeHalf(Hyperparams(), node_id="node-000"),
        data,
        Workspace(build_model("mlp", (3,), 2, seed=0), torch.device("cpu")),
    )
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    return daemon, bus


def _task(*, age_s: float, inline: bool = False, round: int = 4, **meta: object) -> Message:
    """A task the coordinator sent `age_s` seconds ago (by its clock), with the model inside if `inline`."""
    fields: dict[str, Any] = {"task": os.urandom(16), "attempt": 0, "model_topic": Topics("f").model(round),
                              "settings": TrainSettings(local_epochs=1, batch_size=4).to_meta(), **meta}  # fmt: skip
    tensors = {}
    if inline:
        fields |= {"inline": True, "payload": {}}
        tensors = flatten_groups({"model": build_model("mlp", (3,), 2, seed=1).state_dict()})
    return Message(kind=Kind.TASK, federation="f", round=round, sender="coordinator", meta=fields,
                   tensors=tensors, sent_at=time.time() - age_s)  # fmt: skip


@pytest.mark.parametrize("inline", [False, True], ids=["broadcast", "inline"])
async def test_expired_task_is_refused_and_not_acknowledged_or_trained(inline: bool) -> None:
    """Sent 120 s ago with a 30 s deadline: an expired-task error (the receive loop logs and counts it),
    no acknowledgement, no subscription to the model, no training job, no pending task."""
    daemon, bus = _daemon()
    with pytest.raises(TaskError) as info:
        await daemon.tasks.on_task(_task(age_s=120, deadline_s=30, inline=inline))
    assert info.value.reason == "expired-task"
    assert "arrived 120.0 s after it was sent, past its deadline of 30 s (+ 5 s" in info.value.detail
    assert bus.published == [] and bus.subscribed == [] and bus.frames == []
    assert daemon.tasks.pending is None and daemon.tasks.job is None and daemon.player.tasks_received == 0


async def test_fresh_inline_task_is_trained_and_answered() -> None:
    """The counterpart: a task sent just now with a 30 s deadline is trained on and its update sent."""
    daemon, bus = _daemon()
    await daemon.tasks.on_task(_task(age_s=0.0, deadline_s=30, inline=True))
    assert daemon.tasks.job is not None
    await daemon.tasks.job
    assert len(bus.frames) == 1 and daemon.rounds_trained == 1


@pytest.mark.parametrize(
    ("age_s", "deadline_s", "clock_skew_s", "acted_on"),
    [
        (0.5, 30, 5.0, True),  # fresh
        (29.0, 30, 0.0, True),  # late but within its deadline
        (33.0, 30, 5.0, True),  # past the deadline by less than the skew allowed
        (36.0, 30, 5.0, False),  # past the deadline and the skew
        (31.0, 30, 0.0, False),  # no skew allowed
        (3600.0, None, 5.0, True),  # no deadline_s (an older coordinator): never expires
        (-40.0, 30, 5.0, True),  # this clock behind the coordinator's: the task looks younger
    ],
)
async def test_task_deadline_table(age_s: float, deadline_s: float | None, clock_skew_s: float, acted_on: bool) -> None:
    daemon, bus = _daemon(clock_skew_s)
    meta = {} if deadline_s is None else {"deadline_s": deadline_s}
    try:
        await daemon.tasks.on_task(_task(age_s=age_s, **meta))
    except TaskError as exc:
        assert exc.reason == "expired-task" and not acted_on
    else:
        assert acted_on and [m.kind for m in bus.published] == [Kind.ACK]


@pytest.mark.parametrize("deadline_s", [0, -1, "30", True, float("nan")])
async def test_task_with_a_malformed_deadline_is_a_bad_task(deadline_s: object) -> None:
    daemon, bus = _daemon()
    with pytest.raises(TaskError) as info:
        await daemon.tasks.on_task(_task(age_s=0.0, deadline_s=deadline_s))
    assert info.value.reason == "bad-task" and "deadline_s" in info.value.detail and bus.published == []


def test_node_config_refuses_a_negative_clock_skew() -> None:
    with pytest.raises(ValueError, match="clock_skew_s"):
        NodeConfig(node_id="node-000", federation="f", clock_skew_s=-1.0)


async def test_task_for_another_method_is_refused_with_a_failure_report_that_says_why() -> None:
    """A task whose method fingerprint is not the node's: no acknowledgement, no training; one failure
    update goes back naming this node's method, so the coordinator stops waiting and records why."""
    daemon, bus = _daemon()
    await daemon.tasks.on_task(_task(age_s=0.0, deadline_s=30, inline=True, method="0123456789abcdef"))
    assert daemon.tasks.job is None and daemon.tasks.pending is None and bus.frames == []
    [failure] = bus.published
    assert failure.kind == Kind.UPDATE and failure.round == 4
    reason = failure.meta["failed"]
    assert reason.startswith("method-mismatch: the task is for method fingerprint '0123456789abcdef'")
    assert f"this node runs fedavg(weighted=True) with model schema {daemon.fingerprint.schema}" in reason
    assert bus.stats.rejected["method-mismatch"] == 1


async def test_task_with_the_node_s_own_method_is_trained() -> None:
    daemon, bus = _daemon()
    await daemon.tasks.on_task(_task(age_s=0.0, deadline_s=30, inline=True, method=daemon.fingerprint.digest))
    assert daemon.tasks.job is not None
    await daemon.tasks.job
    assert len(bus.frames) == 1 and bus.published == []
