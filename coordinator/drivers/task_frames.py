"""The frames a round's `Configure` step sends: a task per selected node and, for a broadcast, the model.

A part of the MQTT driver (`coordinator.drivers.mqtt`), pure and synchronous: it runs in the lane's
thread, where the half's payload is read whole, and only encodes; publishing them is the driver's. The
task message is built here, in one place (`protocol.Task`), and parsed on the node in one place
(`fednode.task`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedmq.broker import BusConfig, Kind, Message, Topics, encode
from fedmq.broker.codec import encoded_size, with_bytes_replaced
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine import commands as c
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.protocol import Task
from fedmq.fedcore.tensors import flatten_groups
from fedmq.fedcore.training import TrainSettings

SENDER = "coordinator"


@dataclass(frozen=True, slots=True)
class TaskFrame:
    """The task frame of the nodes that share a payload (a sync round's), encoded once with `task`,
    one of their task ids. Each node's own task id is its own (issue 31): its frame is a copy with
    that id written over this one (`for_task`), so that the model riding inline is not encoded again
    for every node; a copy lives only until its publish is acknowledged."""

    frame: bytearray
    task: bytes
    expiry_s: float
    """Its MQTT message expiry, as the engine's `Configure` says (the engine decides deadlines)."""

    def for_task(self, task: bytes) -> bytearray:
        return self.frame if task == self.task else with_bytes_replaced(self.frame, self.task, task)


@dataclass(slots=True)
class Prepared:
    """What a `Configure` step made ready: an encoded task per node and, for a broadcast, the model."""

    frames: dict[str, TaskFrame]
    round: int
    tasks: dict[str, bytes]
    inline: bool
    expiry_s: float
    """The MQTT message expiry of the step's tasks and model: its `Configure`'s `expiry_s`."""
    model: bytearray | None = None


class TaskFrames:
    """Encodes a step's tasks (and model) for one federation and method."""

    def __init__(self, config: CoordinatorConfig, bus_config: BusConfig, method_digest: str) -> None:
        self.config = config
        self.bus_config = bus_config
        self.topics = Topics(config.federation)
        self.method_digest = method_digest

    def prepare(self, command: c.Configure, payload: Payload | Mapping[str, Payload]) -> Prepared:
        """The step's frames for the half's `payload`: one shared by every node, or one per node."""
        if not command.tasks:
            return Prepared({}, command.ctx.round, {}, inline=True, expiry_s=command.expiry_s)
        if isinstance(payload, Payload):
            payloads: Mapping[str, Payload] = dict.fromkeys((t.node for t in command.tasks), payload)
            model = None if command.inline_only else self.model_message(command, payload)
            inline = model is None or self.fits_in_task(model)
        else:  # one payload per node: each rides in its own task
            payloads, model, inline = payload, None, True
        frames: dict[str, TaskFrame] = {}
        if isinstance(payload, Payload):  # one payload: the tasks that differ only in their ids encoded once
            shared: dict[tuple[int, int, int, bytes | None], TaskFrame] = {}
            for t in command.tasks:
                key = (t.round, t.attempt, t.version, t.model)
                if key not in shared:
                    message = self.task_message(command, t, payload if inline else None)
                    shared[key] = TaskFrame(encode(message), t.task, command.expiry_s)
                frames[t.node] = shared[key]
        else:
            for t in command.tasks:
                message = self.task_message(command, t, payloads[t.node])
                frames[t.node] = TaskFrame(encode(message), t.task, command.expiry_s)
        tasks = {t.node: t.task for t in command.tasks}
        prepared = Prepared(frames, command.ctx.round, tasks, inline, command.expiry_s)
        if not inline:
            assert model is not None
            prepared.model = encode(model)
        return prepared

    def model_message(self, command: c.Configure, payload: Payload) -> Message:
        """The round's model broadcast (every selected node reads it)."""
        first = command.tasks[0]
        return Message(
            kind=Kind.MODEL,
            federation=self.config.federation,
            round=first.round,
            sender=SENDER,
            # the attempt's public id, not a task id: every node may read the broadcast (issue 31)
            meta={"model_id": first.model, "payload": dict(payload.meta)},
            tensors=flatten_groups(payload.tensors),
        )

    def task_message(self, command: c.Configure, task: c.TaskSpec, inline: Payload | None) -> Message:
        """One selected node's task; with `inline`, it also carries the model's tensors and payload."""
        meta = Task(
            task_id=task.task,
            attempt=task.attempt,
            version=task.version,
            model_topic=self.topics.model(task.round),
            model_id=task.model,
            deadline_s=command.expiry_s,
            settings=TrainSettings.from_meta(command.settings),
            method=self.method_digest,
            secure_aggregation=self.config.secure_aggregation,
            inline=inline is not None,
            payload=None if inline is None else inline.meta,
        )
        tensors = {} if inline is None else flatten_groups(inline.tensors)
        return Message(
            kind=Kind.TASK, federation=self.config.federation, round=task.round, sender=SENDER,
            meta=meta.to_meta(), tensors=tensors,
        )  # fmt: skip

    def fits_in_task(self, model: Message) -> bool:
        """Whether the round's model is small enough to ride in each task (sized without encoding it)."""
        limit = min(self.config.policy.inline_model_bytes, self.bus_config.chunk_bytes // 2)
        return encoded_size(model) <= limit
