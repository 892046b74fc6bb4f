"""A node's task from its arrival to its update: the part of the node daemon that handles tasks.

A part of the node daemon (`fednode.daemon`), which hands it each task and model message. A task is
parsed and checked (its deadline, its method, the node not stopping, the scenario admitting it);
the node then holds it (`pending`), subscribes to its round's model and acknowledges, unless the model
rides inside the task. When the model comes, the round's job trains and sends the update
(`fednode.update_job`). Draining abandons a pending task (reported as a failure) and lets the job in
hand finish; the scenario going offline drops the pending task.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fedmq.broker import BusClient, Message, Topics
from fedmq.broker.background import Background
from fedmq.broker.errors import BusError
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.masking import SecureAggregationPart
from fedmq.fednode.method_check import MethodCheck
from fedmq.fednode.reports import Reports
from fedmq.fednode.scripted import ScriptPlayer
from fedmq.fednode.task import Task, check_deadline, parse_model, parse_task
from fedmq.fednode.trainer import Trainer
from fedmq.fednode.update_job import UpdateJobs
from fedmq.fednode.workspace import Workspace


class TaskCourse:
    def __init__(
        self,
        config: NodeConfig,
        workspace: Workspace,
        *,
        trainer: Trainer,
        method_check: MethodCheck,
        player: ScriptPlayer,
        secure: SecureAggregationPart,
        reports: Reports,
        updates: UpdateJobs,
        background: Background,
        bus: Callable[[], BusClient],
        crash: Callable[[], None],
        log: logging.LoggerAdapter[Any],
    ) -> None:
        """`bus`: the node's connected bus client (the model's subscription, the count of a refused task);
        `crash`: what the daemon does for the crash fault (drop the connection without a goodbye)."""
        self.config = config
        self.node_id = config.node_id
        self.topics = Topics(config.federation)
        self.workspace = workspace
        self.trainer = trainer
        self.method_check = method_check
        self.player = player
        self.secure = secure
        self.reports = reports
        self.updates = updates
        self.background = background
        self.bus = bus
        self.crash = crash
        self.log = log
        self.pending: Task | None = None
        """The task acknowledged whose model has not come yet."""
        self.job: asyncio.Task[None] | None = None
        """The round's training and update, once its model came."""
        self.draining: str | None = None
        """Why the node is stopping (`drain`), or None: a task that comes meanwhile is refused."""

    async def on_task(self, message: Message, size: int = 0) -> None:
        """A task for this node (`size`: its frame's bytes); TaskError says why one is refused."""
        task = parse_task(message, self.topics, size)
        check_deadline(task, message.sent_at, self.config.clock_skew_s)
        mismatch = self.method_check.mismatch(task.method)
        if mismatch is not None:  # the coordinator stops waiting for this node, and logs why
            self.bus().stats.rejected["method-mismatch"] += 1
            self.log.error("round %d's task refused: %s", task.round, mismatch)
            await self.reports.failure(task, mismatch)
            return
        if self.draining is not None:
            self.log.info("round %d's task refused: the node is stopping (%s)", task.round, self.draining)
            await self.reports.failure(task, f"refused: the node is stopping ({self.draining})")
            return
        if not self.player.admit(task.round):
            return  # scripted: offline, or a dropped task (no ack, no group, no update)
        if task.inline:
            # the model it carries is checked before it replaces the pending task: a refused task
            # (wrong shapes, from anyone who can publish on this topic) must not cost the node the
            # genuine task it holds (issue 31)
            parse_model(message, self.workspace.schema)
        if self.pending is not None:
            self.trainer.withdraw(self.pending)
            if not self.pending.inline and self.pending.model_topic != task.model_topic:
                await self._unsubscribe_model(self.pending)
        self.pending = task
        if task.secure is not None:
            await self.secure.start(
                round=task.round, attempt=task.attempt, task_id=task.task_id, model_id=task.model_id,
                settings=task.secure,
            )  # fmt: skip
        self.trainer.expect(task)
        if task.inline:
            await self.on_model(message, 0)  # the task's frame is the model's
            return
        await self.bus().subscribe(task.model_topic)
        await self.reports.ack(task)
        self.log.debug("task for round %d acknowledged", task.round)

    async def on_model(self, message: Message, size: int = 0) -> None:
        """The model of the pending task (another is ignored): the round's job starts."""
        task = self.pending
        quoted = message.meta.get("model_id", message.meta.get("task"))
        if task is None or message.round != task.round or quoted != task.model_key:
            self.log.debug("model for round %d matches no pending task; ignored", message.round)
            return
        self.pending = None
        if not task.inline:
            # clean-up only: the model arrived, so training need not wait for the broker's UNSUBACK
            self.background.spawn(self._unsubscribe_model(task), f"unsubscribe-{self.node_id}-{task.round}")
        if self.config.script.faults.fail_at_round == task.round:
            self.log.warning("fault injection: crashing mid-round %d", task.round)
            self.crash()
            return
        payload = parse_model(message, self.workspace.schema)
        if self.job is not None and not self.job.done():
            self.log.warning("round %d starts while the previous update is still being produced", task.round)
        received = task.frame_bytes + size
        job = self.updates.run(task, payload, self.player.spell, received)
        self.job = asyncio.create_task(job, name=f"train-{self.node_id}-{task.round}")
        self.job.add_done_callback(self._harvest)

    async def drain(self) -> None:
        """Deal with the task in hand as the node stops (`draining` says why)."""
        reason = self.draining or "draining"
        task, self.pending = self.pending, None
        if task is not None:  # acknowledged, the model not here yet
            self.trainer.withdraw(task)
            self.log.info("draining (%s): abandoning round %d's task, whose model has not come", reason, task.round)
            await self.reports.failure(task, f"abandoned: the node is stopping ({reason})")
        job = self.job
        if job is not None and not job.done():
            self.log.info("draining (%s): finishing the update in hand", reason)
            await asyncio.wait({job})
        self.log.info("drained (%s) after %d rounds trained", reason, self.updates.sent)

    def abandon(self) -> None:
        """Forget the pending task; a job in hand sees its spell ended and sends nothing."""
        task, self.pending = self.pending, None
        if task is not None:
            self.trainer.withdraw(task)
            if not task.inline:
                self.background.spawn(self._unsubscribe_model(task), f"unsubscribe-{self.node_id}-{task.round}")

    async def _unsubscribe_model(self, task: Task) -> None:
        try:
            await self.bus().unsubscribe(task.model_topic)
        except BusError as exc:
            self.log.warning("could not unsubscribe from %s: %s", task.model_topic, exc)

    def withdraw(self) -> None:
        """The node stops: the pending task is given up (its group no longer counts on it)."""
        if self.pending is not None:
            self.trainer.withdraw(self.pending)

    def _harvest(self, job: asyncio.Task[None]) -> None:
        if job.cancelled():
            return
        exc = job.exception()
        if exc is not None:  # a failed publish of the update; training errors are reported in the job
            self.log.error("round job failed: %r", exc, exc_info=exc)
