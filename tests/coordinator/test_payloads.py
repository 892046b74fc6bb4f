"""`configure_round` may give one payload per node: each node's task carries its own (daemon and
in-process driver), and a shared payload for a large model is still broadcast once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedmq.broker import BusConfig, decode
from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.drivers.task_frames import Prepared
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine import make_engine
from fedmq.coordinator.engine.base import Engine
from fedmq.fedcore.algorithms import base
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.training import TrainSettings
from tests.coordinator.engine_helpers import config


class PerNode(base.CoordinatorHalf):
    """Sends node k the model filled with k (and records what comes back)."""

    sync_only = None

    def configure_round(self, ctx: base.RoundContext) -> Mapping[str, base.Payload]:
        return {
            node: base.Payload(tensors={"model": {"w": torch.full((2,), float(i))}}, meta={"k": i})
            for i, node in enumerate(ctx.selected)
        }

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        self.seen = {u.node_id: float(u.payload.tensors["model"]["w"][0]) for u in updates}
        return {}


class Echo(base.NodeHalf):
    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        return base.Payload(tensors={"model": {"w": task.payload.tensors["model"]["w"] + 1}})


def _model() -> nn.Module:
    model = nn.Module()
    model.register_buffer("w", torch.zeros(2))
    return model


def _ctx(selected: tuple[str, ...]) -> base.RoundContext:
    return base.RoundContext(round=0, selected=selected, participation=ParticipationRecord(), settings=TrainSettings())


def _configure(coordinator: Coordinator, command: c.Configure) -> tuple[int, Prepared]:
    """What the daemon's lane does for a Configure: the half's payload, encoded as the step's frames."""
    return coordinator.outbox.encode(command, coordinator.heavy.calls.configure(command))


def test_daemon_prepares_one_inline_task_per_node_with_its_own_payload(tmp_path: Path) -> None:
    """Per-node payloads ride inline in each node's task whatever their size; no broadcast frame."""
    cfg = dataclasses.replace(config(), out_dir=tmp_path)
    coordinator = Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), PerNode(None, model=_model()))
    tasks = tuple(c.TaskSpec(n, bytes([i]) * 16, 0, 0, 0) for i, n in enumerate(("a", "b")))
    step, prepared = _configure(coordinator, c.Configure(1, _ctx(("a", "b")), tasks, TrainSettings().to_meta(), 10.0))
    assert step == 1 and prepared.inline and prepared.model is None
    for i, node in enumerate(("a", "b")):
        message = decode(prepared.frames[node].for_task(tasks[i].task))
        assert message.meta["task"] == tasks[i].task
        assert message.meta["inline"] and message.meta["payload"] == {"k": i} and message.meta["version"] == 0
        assert np.array_equal(message.tensors["model/w"], np.full(2, float(i), np.float32))


class Shared(PerNode):
    """One payload for every node (the usual case: a sync round's model)."""

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:  # type: ignore[override]
        return base.Payload(tensors={"model": {"w": torch.full((2,), 7.0)}}, meta={"k": 7})


@pytest.mark.parametrize("inline_bytes", [0, 1 << 16])
def test_a_sync_rounds_tasks_each_carry_their_nodes_own_id_and_the_broadcast_none(
    tmp_path: Path, inline_bytes: int
) -> None:
    """Issue 31, item 4: one encoding of the round's task, and each node's frame is it with the
    node's own task id (the model inline or not); the broadcast carries the attempt's model id,
    which every task also carries, and no node's task id anywhere in its bytes."""
    cfg = config(policy={"inline_model_bytes": inline_bytes})
    engine = make_engine(cfg, Shared(None, model=_model()).update_schema(), evaluates=False)
    for node in ("a", "b", "c"):
        engine.handle(e.NodeSeen(node, True, 10), 0.0)
    configure = next(x for x in engine.handle(e.Start(), 0.0) if isinstance(x, c.Configure))
    coordinator = Coordinator(
        dataclasses.replace(cfg, out_dir=tmp_path),
        BusConfig.from_url("mqtt://127.0.0.1:1"),
        Shared(None, model=_model()),
    )
    _, prepared = _configure(coordinator, configure)
    assert len({id(f) for f in prepared.frames.values()}) == 1  # encoded once
    ids = {t.task for t in configure.tasks}
    for t in configure.tasks:
        message = decode(prepared.frames[t.node].for_task(t.task))
        assert message.meta["task"] == t.task and message.meta["model_id"] == t.model
        assert bool(message.tensors) == (inline_bytes > 0)
    assert prepared.inline == (inline_bytes > 0)
    if prepared.model is not None:
        broadcast = decode(prepared.model)
        assert "task" not in broadcast.meta and broadcast.meta["model_id"] == configure.tasks[0].model
        assert not any(bytes(prepared.model).find(i) >= 0 for i in ids)


def test_local_driver_gives_each_node_its_own_payload() -> None:
    """Through the engine in process: node a trained from 0s and b from 1s, so they return 1 and 2."""
    half = PerNode(None, model=_model())
    engine: Engine = make_engine(config(rounds=1), half.update_schema(), evaluates=False)
    data = TensorDataset(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), 2)
    fed = LocalFederation(engine, half, {n: LocalNode(Echo(None, node_id=n), data) for n in ("a", "b")}, _model())
    fed.run()
    assert half.seen == {"a": 1.0, "b": 2.0} and engine.state == "finished"
