"""One round's work after the model came: train, then send the update, as the node's scenario says.

A part of the node daemon (`fednode.daemon`), started as a job once a task's model is here. With a
scenario, the modelled download comes first, then the modelled compute time beyond the real one and
the upload, all outside the workspace lock; nothing is sent once the node went offline (its spell
ended). A training that raised, or had nothing to send, is reported as the task's failure, so that
the round does not wait for an update that will never come.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fedmq.broker import encode
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.masking import Draft, SecureAggregationPart
from fedmq.fednode.reports import Reports
from fedmq.fednode.scripted import ScriptPlayer
from fedmq.fednode.task import Task
from fedmq.fednode.trainer import NoUpdate, Trainer


class UpdateJobs:
    """Runs a node's update jobs and counts them (for metrics)."""

    def __init__(
        self,
        config: NodeConfig,
        num_samples: int,
        trainer: Trainer,
        player: ScriptPlayer,
        secure: SecureAggregationPart,
        reports: Reports,
        log: logging.LoggerAdapter[Any],
    ) -> None:
        self.config = config
        self.num_samples = num_samples
        self.trainer = trainer
        self.player = player
        self.secure = secure
        self.reports = reports
        self.log = log
        self.sent = 0
        """Updates sent."""
        self.trainings = 0
        self.train_seconds = 0.0
        """Local trainings finished and their wall seconds (an update abandoned afterwards included)."""

    async def run(self, task: Task, payload: Payload, spell: asyncio.Event, received: int) -> None:
        """Train on `payload` and send the update; `received`: the bytes the task and model weighed,
        for the scenario's modelled download."""
        script, hold = self.config.script, self.player.hold
        if not await hold(script.transfer_s(received), spell):
            return self._abandoned(task)
        try:
            frame, train_s = await self.trainer.produce(task, payload)
        except NoUpdate as exc:
            self.log.warning("round %d: no update to send: %s", task.round, exc)
            if not spell.is_set():
                await self.reports.failure(task, str(exc))
            return
        except Exception as exc:  # the round must not wait for an update that will never come
            if self.reports.bus is not None:
                self.reports.bus.stats.rejected["training-error"] += 1
            self.log.error("training for round %d failed: %r", task.round, exc, exc_info=exc)
            if spell.is_set():
                return self._abandoned(task)
            await self.reports.failure(task, f"{type(exc).__name__}: {exc}")
            return
        self.trainings += 1
        self.train_seconds += train_s
        if not await hold(max(0.0, script.compute_s(self.num_samples) - train_s), spell):
            return self._abandoned(task)
        delay = self.config.script.faults.delay_for(task.round)
        if delay:
            self.log.info("fault injection: delaying round %d's update by %g s", task.round, delay)
            if not await hold(delay, spell):
                return self._abandoned(task)
        if isinstance(frame, Draft):
            masked = await self.secure.masked(
                round=task.round, task_id=task.task_id, draft=frame, wait_s=task.deadline_s, gone=spell
            )
            if masked is None:
                return self._abandoned(task) if spell.is_set() else None
            frame = encode(masked)
        if not await hold(script.transfer_s(len(frame)), spell):
            return self._abandoned(task)
        await self.reports.update(task, frame)
        self.sent += 1
        self.log.info("round %d: trained %.3f s, update of %d bytes sent", task.round, train_s, len(frame))

    def _abandoned(self, task: Task) -> None:
        self.player.abandoned += 1
        self.log.info("scenario: round %d's update is not sent (the node went offline)", task.round)
