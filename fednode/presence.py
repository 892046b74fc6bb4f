"""The node's retained status: what it announces (online with what it holds, or offline) and when.

A part of the node daemon (`fednode.daemon`). The status goes out on every connection (once the inbox
is subscribed: the coordinator sends a task as soon as it reads ``online``), on every scripted
transition, again for each new coordinator run, and when what the trainer would say changes (a site's
live nodes). One at a time, each saying the state when it goes out, so the last one wins.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fedmq.broker import BusClient, Kind, Message, Topics
from fedmq.broker.errors import BusError
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.protocol import Announcement
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.trainer import Trainer

Spawn = Callable[[Coroutine[Any, Any, None], str], object]
"""Runs a background step the daemon keeps until it ends (`broker.background.Background.spawn`)."""


class Presence:
    """The status of one node on its status topic."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        data: TensorDataset,
        device: str,
        method: dict[str, Any],
        trainer: Trainer,
        online: Callable[[], bool],
        shared: bool,
        spawn: Spawn,
        log: logging.LoggerAdapter[Any],
    ) -> None:
        """`online` says whether the node is online now (its scenario); `shared`: several daemons are
        this node (a share group), so none can say which connection this is."""
        self.config = config
        self.topic = Topics(config.federation).node_status(config.node_id)
        self.data = data
        self.device = device
        self.method = method
        self.trainer = trainer
        self.online = online
        self.shared = shared
        self.spawn = spawn
        self.log = log
        self.bus: BusClient | None = None
        """Set before connecting: the on-connect announcement goes through it."""
        self.subscribed = asyncio.Event()
        """Set once the first connection's subscriptions are granted (later ones restore them first)."""
        self._lock = asyncio.Lock()

    def announcement(self, online: bool) -> Announcement:
        """What the node announces, as its trainer completes it: offline, or online with what it holds
        and which connection this is (after a reconnection the coordinator sends the task in hand again;
        daemons sharing one node id count their connections apart, so none of them says it)."""
        if not online:
            return self.trainer.announce(Announcement(online=False))
        histogram = self.data.label_histogram() if self.config.announce_label_histogram else None
        connection = self.bus.connections if self.bus is not None else 0
        return self.trainer.announce(
            Announcement(
                online=True,
                device=self.device,
                num_samples=len(self.data),
                method=self.method,
                connection=None if self.shared else connection,
                label_histogram=None if histogram is None else tuple(histogram),
            )
        )

    def status(self, state: str) -> Message:
        """The status message for `state` (``online`` or ``offline``)."""
        return Message(
            kind=Kind.NODE_STATUS,
            federation=self.config.federation,
            round=-1,
            sender=self.config.node_id,
            meta=self.announcement(state == "online").to_meta(),
        )

    async def announce(self) -> None:
        """The retained status: online, or offline while the scenario says so."""
        if self.bus is None:
            return
        async with self._lock:
            state = "online" if self.online() else "offline"
            await self.bus.publish(self.topic, self.status(state), retain=True)

    def announce_soon(self) -> None:
        """Announce again now that what the node would say may have changed (a site's live nodes);
        before the first subscription the on-connect announcement will say it."""
        if self.subscribed.is_set() and self.bus is not None and self.bus.connected:
            self.spawn(self.announce(), f"announce-{self.config.node_id}")

    async def announce_when_subscribed(self) -> None:
        """The on-connect announcement, once the node's inbox is subscribed: the coordinator sends a
        task as soon as it reads `online`, and on the first connection the hook ran before the
        subscription, so a loaded machine lost the first round's tasks of every node of a process
        (the round waited out its deadline with all of them late). Reconnections restore the
        subscriptions before the hook runs, so this waits only once."""
        await self.subscribed.wait()
        await self.announce()

    async def announce_or_warn(self, what: str) -> None:
        """Announce within 10 s, or log why not (the next connection announces the state then): for a
        coordinator (re)started since the last status, whose first retained read may not be this node's
        any more (issue 31), and for a scripted transition."""
        try:
            await asyncio.wait_for(self.announce(), 10)
        except (BusError, TimeoutError) as exc:
            self.log.warning("could not publish the status %s: %r", what, exc)
