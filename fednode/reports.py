"""What the node tells the coordinator about its tasks: the acknowledgement, the update, a failure,
a step of secure aggregation.

A part of the node daemon (`fednode.daemon`): every message the node sends on its own ack, update and
secure aggregation topics is built and published here (its status is `fednode.presence`'s).
"""

from __future__ import annotations

import logging
from typing import Any

from fedmq.broker import BusClient, Kind, Message, Topics
from fedmq.broker.errors import BusError
from fedmq.fedcore.protocol import SecAggUp, UpdateFailed
from fedmq.fednode.task import Task


class Reports:
    def __init__(self, federation: str, node_id: str, log: logging.LoggerAdapter[Any]) -> None:
        self.federation = federation
        self.node_id = node_id
        self.topics = Topics(federation)
        self.log = log
        self.bus: BusClient | None = None
        """The node's bus client (set by the daemon before it connects)."""

    async def ack(self, task: Task) -> None:
        """The task is held and its model subscribed: the coordinator may send the model."""
        ack = Message(
            kind=Kind.ACK, federation=self.federation, round=task.round, sender=self.node_id,
            meta={"task": task.task_id},
        )  # fmt: skip
        await self.connected().publish(self.topics.ack(self.node_id), ack)

    async def update(self, task: Task, frame: bytes | bytearray) -> None:
        """The encoded update of `task` (`fednode.trainer.encode_update`)."""
        await self.connected().publish_frame(self.topics.update(self.node_id), frame, round=task.round)

    async def failure(self, task: Task, reason: str) -> None:
        """An update without tensors that says why: the coordinator stops waiting for this node."""
        failure = Message(
            kind=Kind.UPDATE, federation=self.federation, round=task.round, sender=self.node_id,
            meta=UpdateFailed(task_id=task.task_id, reason=reason).to_meta(),
        )  # fmt: skip
        try:
            await self.connected().publish(self.topics.update(self.node_id), failure)
        except BusError as exc:
            self.log.warning("could not report the failure of round %d: %s", task.round, exc)

    async def secagg(self, round: int, kind: Kind, step: SecAggUp) -> None:
        """One step of secure aggregation (`fednode.masking`)."""
        message = Message(kind=kind, federation=self.federation, round=round, sender=self.node_id, meta=step.to_meta())
        await self.connected().publish(self.topics.secagg(self.node_id), message)

    def connected(self) -> BusClient:
        if self.bus is None:
            raise RuntimeError("the node is not connected")
        return self.bus
