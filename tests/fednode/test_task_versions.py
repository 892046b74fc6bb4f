"""The node daemon reads the model version a task carries and echoes it as its update's base_version."""

from __future__ import annotations

import os

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
from fedmq.fednode.task import TaskError, parse_task
from fedmq.fednode.trainer import LocalTrainer
from fedmq.fednode.workspace import Workspace


def _daemon() -> NodeDaemon:
    data = TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long), 2)
    return NodeDaemon(
        NodeConfig(node_id="node-000", federation="f"),
        BusConfig.from_url("mqtt://127.0.0.1:1"),
        NodeHalf(Hyperparams(), node_id="node-000"),
        data,
        Workspace(build_model("mlp", (3,), 2, seed=0), torch.device("cpu")),
    )


def _task(**meta: object) -> Message:
    fields = {"task": os.urandom(16), "attempt": 0, "model_topic": Topics("f").model(4),
              "settings": TrainSettings().to_meta(), **meta}  # fmt: skip
    return Message(kind=Kind.TASK, federation="f", round=4, sender="coordinator", meta=fields)


def _trainer(daemon: NodeDaemon) -> LocalTrainer:
    assert isinstance(daemon.trainer, LocalTrainer)
    return daemon.trainer


def test_task_version_is_echoed_as_the_updates_base_version() -> None:
    daemon = _daemon()
    task = parse_task(_task(version=3), daemon.topics)
    assert task.version == 3
    update = decode(_trainer(daemon).encode(task, Payload(tensors={"model": {"w": torch.ones(2)}}), 0.1))
    assert update.meta["base_version"] == 3 and update.meta["task"] == task.task_id


def test_task_without_a_version_gives_an_update_without_one() -> None:
    """A coordinator that sends no version (older ones) gets updates without base_version."""
    daemon = _daemon()
    task = parse_task(_task(), daemon.topics)
    assert task.version is None
    assert "base_version" not in decode(_trainer(daemon).encode(task, Payload(), 0.1)).meta


@pytest.mark.parametrize("version", [-1, "3", True, 2.5])
def test_task_with_a_malformed_version_is_a_bad_task(version: object) -> None:
    with pytest.raises(TaskError) as info:
        parse_task(_task(version=version), _daemon().topics)
    assert info.value.reason == "bad-task" and "version" in info.value.detail
