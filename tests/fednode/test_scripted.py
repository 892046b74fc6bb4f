"""The node daemon's scenario player, without a broker: task admission and drops, the interruptible
modelled sleeps, the transitions in wall time, and the daemon's use of them."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import pytest
import torch

from fedmq.broker import BusConfig, Kind, Message, Topics, decode
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.algorithms.fedavg import Hyperparams, NodeHalf
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.scenario import NodeScript, Transition
from fedmq.fednode.scripted import ScriptPlayer
from fedmq.fednode.task import parse_task
from fedmq.fednode.workspace import Workspace


def _daemon(script: NodeScript, *, group_wait_s: float | None = None) -> NodeDaemon:
    data = TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long), 2)
    return NodeDaemon(
        NodeConfig(node_id="node-000", federation="f", script=script),
        BusConfig.from_url("mqtt://127.0.0.1:1"),
        NodeHalf(Hyperparams(), node_id="node-000"),
        data,
        Workspace(build_model("mlp", (3,), 2, seed=0), torch.device("cpu"), group_wait_s=group_wait_s),
    )


def _task(round: int = 4) -> Message:
    meta = {"task": os.urandom(16), "attempt": 0, "model_topic": Topics("f").model(round),
            "settings": TrainSettings(local_epochs=1, batch_size=4).to_meta()}  # fmt: skip
    return Message(kind=Kind.TASK, federation="f", round=round, sender="coordinator", meta=meta)


class _Bus:
    """Records what the daemon publishes: the part of a BusClient that task handling and the job use."""

    connections = 1

    def __init__(self) -> None:
        self.frames: list[tuple[bytearray, float]] = []
        self.published: list[Message] = []

    async def publish_frame(self, topic: str, frame: bytearray, *, round: int) -> None:
        self.frames.append((frame, time.monotonic()))

    async def publish(self, topic: str, message: Message, **kwargs: Any) -> None:
        self.published.append(message)

    async def subscribe(self, *topics: str) -> None:
        pass

    async def unsubscribe(self, *topics: str) -> None:
        pass


def test_player_admit_counts_tasks_and_drops_as_scripted() -> None:
    """Every task is counted, the dropped ones too; which are dropped is the script's seeded choice."""
    script = NodeScript(drop_p=0.5, seed=3)
    player = ScriptPlayer(script, "node-007")
    admitted = [player.admit(round=k) for k in range(40)]
    assert admitted == [not script.drops("node-007", k) for k in range(40)]
    assert 0 < player.dropped < 40 and player.tasks_received == 40 and player.ignored_offline == 0


def test_player_admit_while_offline_ignores_without_counting_a_task() -> None:
    """A task that races the node going offline is ignored and does not shift the drop sequence."""
    player = ScriptPlayer(NodeScript(starts_online=False, drop_p=1.0), "node-000")
    assert not player.admit(round=0)
    assert player.ignored_offline == 1 and player.tasks_received == 0 and player.dropped == 0


def test_player_default_script_admits_everything_and_holds_nothing() -> None:
    """The default script: every task admitted, a 0 s hold returns at once (awaits nothing)."""
    player = ScriptPlayer(NodeScript(), "node-000")
    assert all(player.admit(round=k) for k in range(100)) and player.dropped == 0
    hold = player.hold(0.0, player.spell)
    with pytest.raises(StopIteration) as done:
        hold.send(None)  # finished on its first step: no suspension point
    assert done.value.value is True


async def test_player_plays_transitions_in_wall_time_and_ends_spells() -> None:
    """Transitions apply at their times from the start; going offline ends the spell (a hold in it
    returns False early), a transition to the current state does nothing."""
    script = NodeScript(
        transitions=(Transition(0.1, False, crash=True), Transition(0.15, False), Transition(0.25, True))
    )
    player = ScriptPlayer(script, "node-000")
    seen: list[tuple[bool, float]] = []
    started = time.monotonic()

    async def change(t: Transition) -> None:
        seen.append((player.online, time.monotonic() - started))

    playing = asyncio.create_task(player.play(started, change))
    spell = player.spell
    assert not await player.hold(5.0, spell)  # woken by the crash at 0.1 s, not after 5 s
    assert 0.09 < time.monotonic() - started < 1.0
    await playing
    assert [online for online, _ in seen] == [False, True]
    assert 0.09 < seen[0][1] < seen[1][1] and seen[1][1] >= 0.24
    assert player.online and not player.spell.is_set() and player.spell is not spell


async def test_dropped_task_is_not_acknowledged_and_joins_no_group() -> None:
    """drop_p = 1: the task is ignored before the node acknowledges it or is expected in a group."""
    daemon = _daemon(NodeScript(drop_p=1.0), group_wait_s=0.5)
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    await daemon.tasks.on_task(_task(), 200)
    assert daemon.tasks.pending is None and bus.published == []
    assert daemon.workspace.groups is not None and daemon.workspace.groups._groups == {}
    assert daemon.player.dropped == 1 and daemon.player.tasks_received == 1


async def test_task_is_acknowledged_and_expected_in_its_group_with_the_default_script() -> None:
    """The counterpart: with the default script the same task is acknowledged and grouped."""
    daemon = _daemon(NodeScript(), group_wait_s=0.5)
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    await daemon.tasks.on_task(_task(), 200)
    assert daemon.tasks.pending is not None and [m.kind for m in bus.published] == [Kind.ACK]
    assert daemon.workspace.groups is not None and len(daemon.workspace.groups._groups) == 1


async def _run_job(daemon: NodeDaemon, received: int) -> asyncio.Task[None]:
    message = _task()
    task = parse_task(message, daemon.topics, received)
    payload = Payload(tensors={"model": {k: v.clone() for k, v in daemon.workspace.model.state_dict().items()}})
    return asyncio.create_task(daemon.updates.run(task, payload, daemon.player.spell, received))


async def test_job_sleeps_link_and_compute_outside_the_workspace_lock() -> None:
    """Download, the compute beyond training and the upload are slept, and another node could take
    the workspace lock meanwhile; the update goes out after at least their sum."""
    script = NodeScript(task_s=0.2, latency_s=0.05, bandwidth_bps=1e6)
    daemon = _daemon(script)
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    started = time.monotonic()
    job = await _run_job(daemon, 50_000)  # 0.05 + 0.05 s download
    await asyncio.sleep(0.05)
    async with asyncio.timeout(0.05):  # free during the download
        async with daemon.workspace.lock:
            pass
    await job
    ((frame, sent_at),) = bus.frames
    assert decode(frame).kind == Kind.UPDATE and daemon.rounds_trained == 1
    floor = script.transfer_s(50_000) + 0.2 + script.transfer_s(len(frame))
    assert sent_at - started > floor - 0.01  # no upper bound: a loaded machine only makes it later


async def test_job_sends_nothing_when_the_node_goes_offline_during_its_sleeps() -> None:
    """The spell ends during the modelled compute time: the job ends early and sends nothing."""
    daemon = _daemon(NodeScript(task_s=5.0))
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    job = await _run_job(daemon, 0)
    await asyncio.sleep(0.2)
    daemon.player._spell.set()  # as `play` does on going offline
    async with asyncio.timeout(1.0):
        await job
    assert bus.frames == [] and daemon.player.abandoned == 1 and daemon.rounds_trained == 0


async def test_offline_transition_announces_offline_and_forgets_the_pending_task() -> None:
    """Going offline publishes the offline status and forgets the task in hand; back online, the
    online announcement again."""
    daemon = _daemon(NodeScript(transitions=(Transition(0.0, False, crash=True), Transition(0.0, True))))
    bus = _Bus()
    daemon._attach(bus)  # type: ignore[arg-type]
    await daemon.tasks.on_task(_task(), 200)
    assert daemon.tasks.pending is not None
    daemon.player.online = False
    await daemon._on_transition(Transition(0.0, False, crash=True))
    assert daemon.tasks.pending is None and bus.published[-1].meta["state"] == "offline"
    await daemon.tasks.on_task(_task(), 200)
    assert daemon.tasks.pending is None and daemon.player.ignored_offline == 1
    daemon.player.online = True
    await daemon._on_transition(Transition(0.0, True))
    method = daemon.fingerprint.to_meta()
    assert bus.published[-1].meta == {
        "state": "online",
        "device": "cpu",
        "num_samples": 8,
        "method": method,
        "connection": 1,
    }
