"""Every message of the protocol, built by the daemons' own builders with fixed inputs.

`record_frames.py` ran these once, before the protocol module existed, and saved the frames in
`frames.json`: that file is the wire format as it was. `test_wire_frames.py` builds them again with
today's code and checks that the bytes are the same, and feeds the recorded frames through the
protocol's parsers. Message ids, send times, task ids and the run id are fixed so that a frame is a
function of the code alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from fedmq.aggregator.upstream import SiteTrainer, no_data
from fedmq.broker import BusConfig, Message, decode, encode
from fedmq.coordinator.config import CoordinatorConfig, RoundPolicy
from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import make_engine
from fedmq.fedcore.algorithms import fedavg
from fedmq.fedcore.algorithms.base import Payload, RoundContext
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.tensors import schema_of
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.task import parse_task
from fedmq.fednode.trainer import LocalTrainer, encode_update
from fedmq.fednode.workspace import Workspace

FED = "wire"
NODE = "node-007"
TASK_ID = bytes(range(16))
UPDATE_ID = bytes(range(16, 32))
MODEL_ID = bytes(range(32, 48))
"""A sync attempt's model id (issue 31): in the task frames since then, which were recorded again."""
SENT_AT = 1_767_225_600.25
"""2026-01-01 00:00:00.25 UTC: every recorded frame's `ts`."""
RUN_ID = "0123456789abcdef"


def _fixed(message: Message, index: int) -> Message:
    """The message with a fixed id and send time (both random or the clock's otherwise)."""
    return dataclasses.replace(message, message_id=index.to_bytes(16, "big"), sent_at=SENT_AT)


def _model() -> torch.nn.Module:
    return build_model("mlp", (3,), 2, seed=0)


def _data(n: int = 6) -> TensorDataset:
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return TensorDataset(x, torch.tensor([i % 2 for i in range(n)]), 2)


def _node(**changes: Any) -> NodeDaemon:
    config = NodeConfig(node_id=NODE, federation=FED, **changes)
    workspace = Workspace(_model(), torch.device("cpu"))
    half = fedavg.NodeHalf(fedavg.Hyperparams(), node_id=NODE)
    return NodeDaemon(config, BusConfig.from_url("mqtt://127.0.0.1:1"), half, _data(), workspace)


def _payload(scale: float = 1.0) -> Payload:
    """A model-shaped payload whose values depend on nothing but `scale`."""
    tensors = {
        name: torch.linspace(-scale, scale, value.numel()).reshape(value.shape).to(value.dtype)
        for name, value in _model().state_dict().items()
    }
    return Payload(tensors={"model": tensors}, meta={"loss": 0.5, "steps": 3})


def _coordinator(tmp_path: Path) -> Coordinator:
    config = CoordinatorConfig(
        federation=FED, rounds=3, seed=0, out_dir=tmp_path, policy=RoundPolicy(fraction=1.0, deadline_s=30.0)
    )
    half = fedavg.CoordinatorHalf(fedavg.Hyperparams(), model=_model())
    return Coordinator(config, BusConfig.from_url("mqtt://127.0.0.1:1"), half, run_id=RUN_ID)


class _Bus:
    """Catches what a daemon publishes (the builders that publish instead of returning)."""

    connections = 3

    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def publish(self, topic: str, message: Message, **_: Any) -> None:
        self.sent.append(message)

    def publish_advisory(self, topic: str, message: Message) -> None:
        self.sent.append(message)


def _configure(settings: TrainSettings, version: int = 4) -> tuple[c.Configure, c.TaskSpec]:
    spec = c.TaskSpec(node=NODE, task=TASK_ID, round=5, attempt=1, version=version, model=MODEL_ID)
    ctx = RoundContext(round=5, selected=(NODE,), participation=ParticipationRecord(), settings=settings)
    return c.Configure(step=1, ctx=ctx, tasks=(spec,), settings=settings.to_meta(), expiry_s=30.0), spec


# -- the builders, one per recorded frame --------------------------------------------------------


def node_status_online() -> Message:
    node = _node(announce_label_histogram=True)
    node.presence.bus = _Bus()  # type: ignore[assignment]  # its connection count goes into the status
    return node.presence.status("online")


def node_status_offline() -> Message:
    return _node().presence.status("offline")


def site_status_online() -> Message:
    """A site aggregator's announcement: the site's capacity and live nodes, no histogram."""
    site = SimpleNamespace(live=2, capacity=40)
    workspace = Workspace(_model(), torch.device("cpu"))
    half = fedavg.NodeHalf(fedavg.Hyperparams(), node_id=NODE)
    config = NodeConfig(node_id=NODE, federation=FED)
    trainer = SiteTrainer(site, config)  # type: ignore[arg-type]
    upstream = NodeDaemon(
        config, BusConfig.from_url("mqtt://127.0.0.1:1"), half, no_data(), workspace, trainer=trainer,
        share_group="fedmq-wire-site",
    )  # fmt: skip
    return upstream.presence.status("online")


def task_broadcast(tmp_path: Path) -> Message:
    command, spec = _configure(TrainSettings(lr=0.05, max_grad_norm=1.0))
    return _coordinator(tmp_path).outbox.frames.task_message(command, spec, None)


def task_inline(tmp_path: Path) -> Message:
    command, spec = _configure(TrainSettings(local_epochs=2, drop_last=True), version=0)
    return _coordinator(tmp_path).outbox.frames.task_message(command, spec, _payload())


def _node_task(tmp_path: Path, node: NodeDaemon) -> Any:
    frame = encode(_fixed(task_broadcast(tmp_path), 99))
    return parse_task(decode(frame), node.topics, len(frame))


def _trainer(node: NodeDaemon) -> LocalTrainer:
    assert isinstance(node.trainer, LocalTrainer)
    return node.trainer


def update(tmp_path: Path) -> Message:
    node = _node()
    return decode(_trainer(node).encode(_node_task(tmp_path, node), _payload(0.5), 1.25, received=_payload()))


def update_compressed(tmp_path: Path) -> Message:
    node = _node(compression=Compression(mode="int8-block", block=16))
    return decode(_trainer(node).encode(_node_task(tmp_path, node), _payload(0.5), 0.75, received=_payload()))


def update_from_site(tmp_path: Path) -> Message:
    node = _node()
    task = _node_task(tmp_path, node)
    frame = encode_update(
        task, _payload(0.5), 2.5, federation=FED, sender=NODE, num_samples=40, compression=Compression(), site_nodes=3
    )
    return decode(frame)


def update_failed(tmp_path: Path) -> Message:
    node = _node()
    bus = _Bus()
    node._attach(bus)  # type: ignore[arg-type]
    asyncio.run(node.reports.failure(_node_task(tmp_path, node), "RuntimeError: out of memory"))
    return bus.sent[-1]


def _local() -> LocalFederation:
    config = CoordinatorConfig(federation=FED, rounds=3, seed=0, compression=Compression(mode="float16"))
    half = fedavg.CoordinatorHalf(fedavg.Hyperparams(), model=_model())
    engine = make_engine(config, {"model": schema_of(_model().state_dict())}, evaluates=False)
    node = LocalNode(fedavg.NodeHalf(fedavg.Hyperparams(), node_id=NODE), _data())
    return LocalFederation(engine=engine, half=half, nodes={NODE: node}, workspace=_model())


def update_local() -> Message:
    """The in-process driver's update (`LocalFederation.produce`), float16-compressed."""
    _, spec = _configure(TrainSettings())
    return _local().produce(spec, _payload(), TrainSettings(), 2.0, trained=_payload(0.5))


class _Broken:
    """A training output that raises when read, as a failed training step does."""

    meta: dict[str, Any] = {}

    @property
    def tensors(self) -> Any:
        raise RuntimeError("out of memory")


def update_local_failed() -> Message:
    """The in-process driver's report of a failed training."""
    _, spec = _configure(TrainSettings())
    return _local().produce(spec, _payload(), TrainSettings(), 2.0, trained=_Broken())  # type: ignore[arg-type]


def coordinator_status(tmp_path: Path) -> Message:
    fields = {"round": 5, "rounds": 3, "model_version": 4, "live_nodes": 7, "round_done": 5, "accuracy": 0.75,
              "best_accuracy": 0.8}  # fmt: skip
    return _coordinator(tmp_path).statuses.message("running", fields)


def coordinator_status_async(tmp_path: Path) -> Message:
    """The asynchronous engine's status: `round` is the model version, with `engine` and `in_flight`."""
    fields = {"round": 7, "rounds": 50, "model_version": 7, "engine": "async", "in_flight": 4, "live_nodes": 9,
              "round_done": 6, "accuracy": 0.5, "best_accuracy": 0.625}  # fmt: skip
    return _coordinator(tmp_path).statuses.message("running", fields)


def coordinator_status_relay(tmp_path: Path) -> Message:
    """A site's relay engine's status: it does not know the run's rounds (nil on the wire)."""
    fields = {"round": 2, "rounds": None, "model_version": 2, "live_nodes": 3}
    return _coordinator(tmp_path).statuses.message("finished", fields)


def coordinator_status_waiting(tmp_path: Path) -> Message:
    coordinator = _coordinator(tmp_path)
    return coordinator.statuses.message("waiting", coordinator.engine.status().fields)


def coordinator_will(tmp_path: Path) -> Message:
    """The coordinator's last will (`offline`), registered before any round."""
    return _coordinator(tmp_path).statuses.message("offline", {})


def receipt(tmp_path: Path, status: str = "received", reason: str = "") -> Message:
    coordinator = _coordinator(tmp_path)
    bus = _Bus()
    coordinator._attach(bus)  # type: ignore[arg-type]
    coordinator.outbox.receipt(c.Receipt(NODE, 5, TASK_ID, UPDATE_ID, status, reason))
    return bus.sent[-1]


def receipt_rejected(tmp_path: Path) -> Message:
    return receipt(tmp_path, "rejected", "wrong-shape")


def receipt_without_task(tmp_path: Path) -> Message:
    """A receipt for an update that quoted no task id (`task` is then nil on the wire)."""
    coordinator = _coordinator(tmp_path)
    bus = _Bus()
    coordinator._attach(bus)  # type: ignore[arg-type]
    coordinator.outbox.receipt(c.Receipt(NODE, 5, None, UPDATE_ID, "late", "the round closed before it arrived"))
    return bus.sent[-1]


BUILDERS: dict[str, Callable[..., Message]] = {
    "node-status-online": node_status_online,
    "node-status-offline": node_status_offline,
    "site-status-online": site_status_online,
    "task-broadcast": task_broadcast,
    "task-inline": task_inline,
    "update": update,
    "update-compressed": update_compressed,
    "update-from-site": update_from_site,
    "update-failed": update_failed,
    "update-local": update_local,
    "update-local-failed": update_local_failed,
    "coordinator-status": coordinator_status,
    "coordinator-status-waiting": coordinator_status_waiting,
    "coordinator-will": coordinator_will,
    "receipt": receipt,
    "receipt-rejected": receipt_rejected,
    "receipt-without-task": receipt_without_task,
    # recorded later, from the code before the protocol module (a3d964b); new names go last: the
    # message id is the builder's position
    "coordinator-status-async": coordinator_status_async,
    "coordinator-status-relay": coordinator_status_relay,
}


def build(name: str, tmp_path: Path) -> bytes:
    """The frame `name`'s builder makes today, with its id and time fixed."""
    builder = BUILDERS[name]
    takes_path = "tmp_path" in builder.__code__.co_varnames[: builder.__code__.co_argcount]
    message = builder(tmp_path) if takes_path else builder()
    return bytes(encode(_fixed(message, list(BUILDERS).index(name) + 1)))


__all__ = ["BUILDERS", "FED", "NODE", "build"]
