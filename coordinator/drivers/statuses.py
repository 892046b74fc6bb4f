"""The coordinator's status, on the retained topics nodes and watchers follow.

A part of the MQTT driver (`coordinator.drivers.mqtt`). Statuses go out in the order the engine made
them, each on the status topic (watchers) and, when the state changed, on the state topic (nodes).
The last one, the run's end, is published even when the bus client died: through one fresh
connection, so that no node waits for tasks that never come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from fedmq.broker import BusClient, BusConfig, Kind, Message, Topics
from fedmq.broker.errors import BusError
from fedmq.coordinator.drivers.task_frames import SENDER
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint
from fedmq.fedcore.protocol import CoordinatorStatus, RunState

logger = logging.getLogger("fedmq.coordinator.drivers.mqtt")


class Statuses:
    def __init__(
        self,
        bus_config: BusConfig,
        federation: str,
        client_id: str,
        run_id: str,
        fingerprint: MethodFingerprint,
        now_fields: Callable[[], Mapping[str, Any]],
    ) -> None:
        """`now_fields`: what the engine's status says now (for a status asked with no fields of its own)."""
        self.bus_config = bus_config
        self.federation = federation
        self.client_id = client_id
        self.run_id = run_id
        self.fingerprint = fingerprint
        self.topics = Topics(federation)
        self.bus: BusClient | None = None
        """The connected bus (set by the daemon while it serves)."""
        self._now_fields = now_fields
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._published_state: RunState | None = None

    def message(self, state: str, fields: Mapping[str, Any]) -> Message:
        """The status the engine asked for (`fields`: what it says besides the state; none: the engine's now)."""
        status = CoordinatorStatus(
            state=RunState(state), run_id=self.run_id, method=self.fingerprint.to_meta(),
            **(fields or self._now_fields()),
        )  # fmt: skip
        return Message(
            kind=Kind.COORDINATOR_STATUS,
            federation=self.federation,
            round=-1 if status.round is None else status.round,
            sender=SENDER,
            meta=status.to_meta(),
        )

    def put(self, state: str, fields: Mapping[str, Any]) -> None:
        """Queue a status for `publish_in_order`."""
        self._queue.put_nowait(self.message(state, fields))

    async def publish_in_order(self) -> None:
        """Publish the queued statuses, one after another, until cancelled."""
        while True:
            message = await self._queue.get()
            try:
                await self._publish(message)
            except BusError as exc:
                logger.warning("could not publish the status: %s", exc)
            finally:
                self._queue.task_done()

    async def _publish(self, message: Message) -> None:
        if self.bus is None:
            raise RuntimeError("the coordinator is not connected")
        await self.bus.publish(self.topics.coordinator_status, message, retain=True)
        state = RunState(message.meta["state"])
        if state != self._published_state:
            await self.bus.publish(self.topics.coordinator_state, message, retain=True)
            self._published_state = state

    async def publish_final(self, state: RunState, publisher: asyncio.Task[None]) -> None:
        """After the queued statuses, the run's end; then `publisher` (`publish_in_order`) is cancelled."""
        final: Message | None = None
        try:
            async with asyncio.timeout(5):
                await self._queue.join()
                final = self.message(state, {})
                await self._publish(final)
        except (BusError, TimeoutError) as exc:
            logger.warning("could not publish the final status: %s", exc)
            if final is not None and self.bus is not None and self.bus.failed:
                await self._publish_anew(final)
        finally:
            publisher.cancel()

    async def _publish_anew(self, message: Message) -> None:
        """The bus client died (its will said `offline` on the status topic, which nodes do not
        follow): one fresh connection publishes the final state, so that the nodes learn the run
        ended instead of waiting for tasks that never come (issue 31)."""
        client = BusClient(
            self.bus_config,
            client_id=f"{self.client_id}-final",
            federation=self.federation,
            logger=logger.getChild("bus"),
        )
        try:
            async with asyncio.timeout(10), client as bus:
                await bus.publish(self.topics.coordinator_status, message, retain=True)
                await bus.publish(self.topics.coordinator_state, message, retain=True)
            logger.info("the final state (%s) published through a new connection", message.meta["state"])
        except (BusError, TimeoutError) as exc:
            logger.warning("the nodes could not be told that the run ended: %s", exc)
