"""What the coordinator sends the nodes when its engine asks: tasks, model broadcasts and resends,
secure aggregation's steps and receipts.

A part of the MQTT driver (`coordinator.drivers.mqtt`). A `Configure` step's frames are encoded in
the lane's thread (`encode`) and kept here until the engine's `SendTask`s and `Broadcast` send them
(`keep`); the tasks one event asks for go out together, one publish call per shared frame (`flush`).
Each node's last task is held until it acknowledges or answers it, and sent again when it announces
itself on a new connection (after a broker restart, its subscription may be newer than the task).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple

from fedmq.broker import BusClient, BusConfig, Kind, Message, Topics
from fedmq.broker.background import Background
from fedmq.broker.errors import BusError
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.task_frames import SENDER, Prepared, TaskFrame, TaskFrames
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.protocol import Receipt, SecAggDirectory, SecAggShared, SecAggUnmask

logger = logging.getLogger("fedmq.coordinator.drivers.mqtt")

SECAGG_KINDS = {
    SecAggDirectory: Kind.SECAGG_DIRECTORY,
    SecAggShared: Kind.SECAGG_SHARED,
    SecAggUnmask: Kind.SECAGG_UNMASK,
}


class Queued(NamedTuple):
    """A task to publish: to `node`, with its own task id, in `round`, from the step's `frame`."""

    node: str
    task_id: bytes
    round: int
    frame: TaskFrame


class Outbox:
    def __init__(
        self,
        config: CoordinatorConfig,
        bus_config: BusConfig,
        method_digest: str,
        post: Callable[[e.Event], None],
        background: Background,
    ) -> None:
        """`post` hands the engine what publishing found (a task that could not be sent)."""
        self.config = config
        self.bus_config = bus_config
        self.topics = Topics(config.federation)
        self.frames = TaskFrames(config, bus_config, method_digest)
        self.bus: BusClient | None = None
        """The connected bus (set by the daemon while it serves)."""
        self._post = post
        self._background = background
        self._prepared: dict[int, Prepared] = {}
        """Encoded tasks not yet sent, by Configure step (a step goes once its tasks are out, except the
        latest broadcast step, whose model a late acknowledgement may still need)."""
        self._queued: list[Queued] = []
        """Tasks to publish once the engine's commands for the current event are executed."""
        self._open_tasks: dict[str, tuple[bytes, int, TaskFrame]] = {}
        """Each node's last task frame (task id, round, frame) until the node acknowledges or answers it."""

    # -- a step's frames -------------------------------------------------------------------

    def encode(self, command: c.Configure, payload: Payload | Mapping[str, Payload]) -> tuple[int, Prepared]:
        """The step's frames for the half's payload (in the lane's thread: the model is read whole)."""
        return command.step, self.frames.prepare(command, payload)

    def keep(self, made: tuple[int, Prepared]) -> e.Configured:
        """On the event loop: keep the step's frames for its SendTasks, and only the newest broadcast."""
        step, prepared = made
        if prepared.model is not None:
            for old in [k for k, p in self._prepared.items() if p.model is not None]:
                self._prepared[old].model = None
                self._forget_if_sent(old)
        if prepared.frames or prepared.model is not None:
            self._prepared[step] = prepared
        return e.Configured(step, inline=prepared.inline)

    def _forget_if_sent(self, step: int) -> None:
        prepared = self._prepared.get(step)
        if prepared is not None and not prepared.frames and prepared.model is None:
            del self._prepared[step]

    # -- tasks -----------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether tasks are queued for `flush`."""
        return bool(self._queued)

    def send_task(self, command: c.SendTask) -> None:
        """Queued: the tasks an event asks for go out together (`flush`)."""
        prepared = self._prepared.get(command.step)
        frame = prepared.frames.pop(command.node, None) if prepared else None
        if prepared is None or frame is None:
            logger.error("no prepared task for %s in step %d", command.node, command.step)
            return
        self._queued.append(Queued(command.node, prepared.tasks.get(command.node, b""), prepared.round, frame))
        self._forget_if_sent(command.step)

    def flush(self) -> None:
        """Publish the queued tasks: the nodes that share a frame (a round's, the same but for each
        node's task id) in one `publish_many`."""
        queued, self._queued = self._queued, []
        groups: dict[int, list[Queued]] = {}
        for item in queued:
            groups.setdefault(id(item.frame), []).append(item)
        for items in groups.values():
            self._background.spawn(self.publish_tasks(items), "publish-tasks")

    async def publish_tasks(self, items: list[Queued]) -> None:
        """Publish tasks that share a frame; a node whose task could not be published is reported
        (TaskUnsent)."""
        round, shared = items[0].round, items[0].frame
        topics = {self.topics.task(item.node): (item.node, item.task_id) for item in items}
        if self.held_for_resend(shared.frame):
            for item in items:
                self._open_tasks[item.node] = (item.task_id, round, shared)
        frames = {topic: shared.for_task(task_id) for topic, (_, task_id) in topics.items()}
        try:
            failed = await self._bus().publish_many(list(topics), frames, round=round, expiry_s=shared.expiry_s)
        except BusError as exc:
            logger.warning("round %d: %d tasks failed: %s", round, len(topics), exc)
            failed = list(topics)
        for topic in failed:
            node, task_id = topics[topic]
            self.answered(node, task_id)  # reported unsent: the engine no longer waits for it
            logger.warning("round %d: the task to %s could not be published", round, node)
            self._post(e.TaskUnsent(node, task_id))

    def held_for_resend(self, frame: bytearray) -> bool:
        """Whether a task frame is kept until its node answers (`resend_open_task`): up to what a model
        may weigh inside a task, plus its header, which every round's shared task frame is. A larger
        per-node payload is not kept: held through training for every node, it would multiply memory."""
        limit = min(max(self.config.policy.inline_model_bytes, 0), self.bus_config.chunk_bytes // 2) + 4096
        return len(frame) <= limit

    def answered(self, node: str, task: object) -> None:
        """The node acknowledged or answered its open task: it has it, nothing to send again."""
        held = self._open_tasks.get(node)
        if held is not None and held[0] == task:
            del self._open_tasks[node]

    def resend_open_task(self, node: str) -> None:
        """A live node announced itself on a new connection: after a broker restart its subscriptions
        may be new, so the task published before it re-subscribed was lost (issue 31).
        The same frame goes again; a node that had it drops the copy by its message id, and one that
        arrives past its deadline is refused there as expired."""
        held = self._open_tasks.get(node)
        if held is None or self.bus is None:
            return
        task_id, round, frame = held
        logger.info("round %d: %s announced itself again with its task unanswered: the task is sent again", round, node)
        publish = self.bus.publish_frame(
            self.topics.task(node), frame.for_task(task_id), round=round, expiry_s=frame.expiry_s
        )
        self._background.spawn(publish, "resend-task")

    # -- the model -------------------------------------------------------------------------

    def broadcast(self, command: c.Broadcast) -> None:
        prepared = self._prepared.get(command.step)
        if prepared is None or prepared.model is None:
            logger.error("no model prepared for the broadcast of step %d", command.step)
            return
        frame, expiry_s = prepared.model, prepared.expiry_s

        async def send() -> None:
            try:
                await self._bus().publish_frame(
                    self.topics.model(command.round), frame, round=command.round, expiry_s=expiry_s
                )
            except BusError as exc:
                logger.error("round %d: model broadcast failed: %s", command.round, exc)

        self._background.spawn(send(), "broadcast")

    def resend(self, command: c.Resend) -> None:
        """The step's model again, to one node that asked for it."""
        prepared = self._prepared.get(command.step)
        if prepared is None or prepared.model is None:
            return
        topic = self.topics.direct_model(command.node)
        publish = self._bus().publish_frame(topic, prepared.model, round=prepared.round, expiry_s=prepared.expiry_s)
        self._background.spawn(publish, "resend-model")

    # -- one node's messages ---------------------------------------------------------------

    def send_secagg(self, command: c.SendSecAgg) -> None:
        """A step of secure aggregation to one node; it expires with the step (`secure_timeout_s`)."""
        message = Message(
            kind=Kind(SECAGG_KINDS[type(command.message)]),
            federation=self.config.federation,
            round=command.round,
            sender=SENDER,
            meta=command.message.to_meta(),
        )
        publish = self._bus().publish(
            self.topics.node_secagg(command.node), message, expiry_s=self.config.secure_timeout_s
        )
        self._background.spawn(publish, "secagg")

    def receipt(self, command: c.Receipt) -> None:
        """What became of a node's update (folded, late, refused), as advice: never retried."""
        receipt = Message(
            kind=Kind.RECEIPT,
            federation=self.config.federation,
            round=command.round,
            sender=SENDER,
            meta=Receipt(
                status=command.status, reason=command.reason, task_id=command.task, update_id=command.update_id
            ).to_meta(),
        )
        self._bus().publish_advisory(self.topics.receipt(command.node), receipt)

    def _bus(self) -> BusClient:
        if self.bus is None:
            raise RuntimeError("the coordinator is not connected")
        return self.bus
