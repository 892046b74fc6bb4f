"""The node daemon's secure-aggregation part: the `secagg-*` steps of its latest tasks over the bus.

The daemon hands it what it needs from outside (how to publish a step, the node's sample count) and
calls it at three points: a secure task arrived (`start`: the keys go out), a `secagg-*` message came
from the coordinator (`on_message`: answered at once), and the task's training is done (`masked`:
the update, once the shared step says against whom to mask). The protocol itself, pure and shared
with the in-process driver, is `fedcore.secure_task.SecureTask`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from fedmq.broker import Kind, Message
from fedmq.fedcore import protocol
from fedmq.fedcore.masked import round_key
from fedmq.fedcore.protocol import ProtocolError, SecAggDirectory, SecAggShared, SecAggUnmask, SecAggUp, Update
from fedmq.fedcore.secagg import SecAggSettings
from fedmq.fedcore.secure_task import SecureTask
from fedmq.fedcore.tensors import flatten_groups

TASKS_KEPT = 4
"""Tasks whose secure aggregation a node keeps answering (its unmask step comes after its update)."""
KINDS = frozenset({Kind.SECAGG_DIRECTORY, Kind.SECAGG_SHARED, Kind.SECAGG_UNMASK})
"""What the coordinator sends a node on its secagg topic."""

Publish = Callable[[int, Kind, SecAggUp], Awaitable[None]]
"""Send one step of the node's (round, kind, message) on its secagg topic."""


@dataclass(frozen=True, slots=True)
class Draft:
    """A secure task's update before masking: its meta and the model's change (a copy: the workspace
    is free again), masked once the shared step says against whom."""

    meta: Update
    change: np.ndarray


@dataclass(slots=True)
class _Held:
    task: SecureTask
    shared: asyncio.Event


class SecureAggregationPart:
    """One node's secure aggregation over the bus (module docstring)."""

    def __init__(
        self,
        *,
        federation: str,
        node_id: str,
        num_samples: int,
        publish: Publish,
        log: logging.LoggerAdapter,  # type: ignore[type-arg]
    ) -> None:
        self.federation = federation
        self.node_id = node_id
        self.num_samples = num_samples
        self._publish = publish
        self._log = log
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        """By task id, the latest tasks' secure aggregation (`TASKS_KEPT`)."""

    async def start(
        self, *, round: int, attempt: int, task_id: bytes, model_id: bytes | None, settings: SecAggSettings
    ) -> None:
        """A secure task arrived: its keys go out at once (the directory and the masking follow)."""
        if model_id is None:
            raise ProtocolError("bad-task", "a secure-aggregation task without the attempt's model_id")
        task = SecureTask(
            settings,
            round_key(self.federation, round, attempt, model_id),
            node=self.node_id,
            task_id=task_id,
            num_samples=self.num_samples,
        )
        self._held[task_id] = _Held(task, asyncio.Event())
        while len(self._held) > TASKS_KEPT:
            self._held.popitem(last=False)
        await self._publish(round, Kind.SECAGG_KEYS, task.keys())

    async def on_message(self, message: Message) -> None:
        """A step from the coordinator: answered at once (the unmask step after the update), or refused
        (ProtocolError: counted by the daemon, never answered)."""
        step = protocol.parse(str(message.kind), message.meta)
        if not isinstance(step, SecAggDirectory | SecAggShared | SecAggUnmask):
            raise ProtocolError("unexpected-kind", f"{message.kind} is not sent to nodes")
        held = self._held.get(step.task_id)
        if held is None:
            raise ProtocolError("wrong-round", f"a {message.kind} message for no secure task this node holds")
        if isinstance(step, SecAggDirectory):
            await self._publish(message.round, Kind.SECAGG_SHARES, held.task.on_directory(step))
        elif isinstance(step, SecAggShared):
            held.task.on_shared(step)
            held.shared.set()
        else:
            await self._publish(message.round, Kind.SECAGG_REVEAL, held.task.on_unmask(step))

    async def masked(
        self, *, round: int, task_id: bytes, draft: Draft, wait_s: float | None, gone: asyncio.Event
    ) -> Message | None:
        """The update, masked once the shared step came; None when it did not within `wait_s`, when the
        task is no longer held, or when `gone` was set meanwhile (the node went offline)."""
        held = self._held.get(task_id)
        if held is None:
            self._log.warning("round %d: the secure task is no longer held; no update", round)
            return None
        waiter = asyncio.ensure_future(held.shared.wait())
        offline = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({waiter, offline}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            offline.cancel()
        if gone.is_set():
            return None
        if not held.shared.is_set():
            self._log.warning("round %d: no shared step from the coordinator in time; the update is not sent", round)
            return None
        masked = await asyncio.to_thread(held.task.mask_change, draft.change)
        meta = dataclasses.replace(draft.meta, payload={**draft.meta.payload, "secagg_clipped": masked.clipped})
        return Message(
            kind=Kind.UPDATE, federation=self.federation, round=round, sender=self.node_id,
            meta=meta.to_meta(), tensors=flatten_groups(masked.tensors),
        )  # fmt: skip
