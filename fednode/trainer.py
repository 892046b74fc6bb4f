"""Where a node daemon's updates come from: the part that makes a node of data what it is.

The node daemon (`fednode.daemon`) receives tasks and models, plays the scenario and publishes; what
it sends for a task comes from its `Trainer`. A node of data trains on it (`LocalTrainer`: alone under
the process's workspace lock, or with the process's group when ``hosting.vectorize`` forms one); a
site aggregator's upstream node runs a site round instead (`aggregator.upstream.SiteTrainer`). The
update's frame is built here, in one place (`encode_update`), from the update every node makes
(`fedcore.node_update`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import torch

from fedmq.broker import Kind, Message, encode
from fedmq.fedcore.algorithms.base import GroupMember, NodeHalf, Payload, TaskInput
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.masked import weighted_change
from fedmq.fedcore.node_update import node_generator, node_update, update_header
from fedmq.fedcore.protocol import Announcement
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.masking import Draft
from fedmq.fednode.task import Task
from fedmq.fednode.workspace import Workspace

Produced = tuple[bytearray | Draft, float]
"""An update's frame (or, with secure aggregation, the draft the masking step completes) and the
seconds of training it took."""


class NoUpdate(Exception):
    """The node has no update for a task, for a reason it reports to the coordinator (a site
    aggregator whose nodes sent nothing): a failure of the round, not of the daemon."""


class Trainer(Protocol):
    """What a node daemon asks of the part that makes its updates."""

    def announce(self, announcement: Announcement) -> Announcement:
        """The node's online announcement as this trainer completes it (what it holds; offline while it
        cannot answer a task)."""
        ...

    def expect(self, task: Task) -> None:
        """The node took `task`; its model is coming (a vectorised group counts on this node)."""
        ...

    def withdraw(self, task: Task) -> None:
        """The node dropped `task` before its model came."""
        ...

    async def produce(self, task: Task, payload: Payload) -> Produced:
        """The update for `task` from the model it carried (`payload`); `NoUpdate` when there is none."""
        ...


def encode_update(
    task: Task,
    result: Payload,
    train_s: float,
    *,
    federation: str,
    sender: str,
    num_samples: int,
    compression: Compression,
    received: Payload | None = None,
    site_nodes: int | None = None,
) -> bytearray:
    """The update's frame, compressed as configured (`received`, the task's payload, is the base of a
    delta); it claims `num_samples` and, from a site aggregator, the number of its nodes' updates it
    holds (`site_nodes`)."""
    meta, tensors = node_update(
        task.task_id, task.version, result, num_samples=num_samples, train_seconds=train_s,
        compression=compression, received=received, site_nodes=site_nodes,
    )  # fmt: skip
    message = Message(
        kind=Kind.UPDATE, federation=federation, round=task.round, sender=sender, meta=meta.to_meta(), tensors=tensors
    )
    return encode(message)


class LocalTrainer:
    """A node of data: trains the method's node half on it, with the process's group when one forms."""

    def __init__(
        self,
        config: NodeConfig,
        half: NodeHalf,
        data: TensorDataset,
        workspace: Workspace,
        log: logging.LoggerAdapter[Any],
    ) -> None:
        self.config = config
        self.half = half
        self.data = data
        self.workspace = workspace
        self.log = log

    def announce(self, announcement: Announcement) -> Announcement:
        return announcement  # the daemon's says what a node of data holds

    def expect(self, task: Task) -> None:
        groups = self.workspace.groups if self._grouped(task) else None
        if groups is None:
            return
        groups.expect(task.group_key, self.config.node_id)
        if task.inline and not groups.warned_inline:
            groups.warned_inline = True
            self.log.warning(
                "the model comes inside the task, so a group forms from the tasks that arrived before it:"
                " with hosting.vectorize set the coordinator's policy.inline_model_bytes to 0"
            )

    def withdraw(self, task: Task) -> None:
        if self.workspace.groups is not None:
            self.workspace.groups.withdraw(task.group_key, self.config.node_id)

    async def produce(self, task: Task, payload: Payload) -> Produced:
        """Trained with this task's group when it forms, else alone under the workspace lock."""
        groups = self.workspace.groups
        if groups is not None and self._grouped(task):
            member = GroupMember(
                half=self.half, task=self._task_input(task, payload), data=self.data, generator=self._generator(task)
            )
            grouped = await groups.train(task.group_key, member)
            if grouped is not None:
                result, train_s = grouped
                return await asyncio.to_thread(self._frame, task, result, train_s, payload), train_s
        async with self.workspace.lock:
            return await asyncio.to_thread(self._train_and_encode, task, payload)

    def encode(self, task: Task, result: Payload, train_s: float, *, received: Payload | None = None) -> bytearray:
        """This node's update for `task`: claiming its data, compressed as configured."""
        return encode_update(
            task, result, train_s, federation=self.config.federation, sender=self.config.node_id,
            num_samples=len(self.data), compression=self.config.compression, received=received,
        )  # fmt: skip

    def _grouped(self, task: Task) -> bool:
        """Whether this task's training goes through the process's group (``hosting.vectorize``); never
        in a round where a fault makes this node fail on its own."""
        groups, faults = self.workspace.groups, self.config.script.faults
        if groups is None or task.round in (faults.error_at_round, faults.fail_at_round):
            return False
        return groups.admits(self.half)

    def _train_and_encode(self, task: Task, payload: Payload) -> Produced:
        """Runs in a worker thread; encodes before releasing the workspace, whose tensors the update aliases."""
        if self.config.script.faults.error_at_round == task.round:
            raise RuntimeError(f"fault injection: training error at round {task.round}")
        started = time.perf_counter()
        result = self.half.train(
            self._task_input(task, payload), self.workspace.model, self.data, self._generator(task)
        )
        train_s = time.perf_counter() - started
        return self._frame(task, result, train_s, payload), train_s

    def _frame(self, task: Task, result: Payload, train_s: float, received: Payload) -> bytearray | Draft:
        """The update's frame; with secure aggregation, the draft the shared step lets it mask (`masking`):
        the change from the model the task carried, copied out of the workspace."""
        if task.secure is None:
            return self.encode(task, result, train_s, received=received)
        meta = update_header(task.task_id, task.version, result.meta, num_samples=len(self.data), train_seconds=train_s)
        return Draft(meta, weighted_change(result.tensors["model"], received.tensors["model"], 1.0))

    def _generator(self, task: Task) -> torch.Generator:
        return node_generator(self.config.seed, self.config.node_id, task.round, task.attempt, self.workspace.device)

    def _task_input(self, task: Task, payload: Payload) -> TaskInput:
        return TaskInput(
            node_id=self.config.node_id,
            round=task.round,
            payload=payload,
            settings=task.settings,
            scratch=self.workspace.scratch,
        )
