"""The aggregator's upstream half: one node of the federation that speaks for a site's nodes.

It is the node daemon (announcement, tasks, deadlines, the method check, drain, the update's
publish), except for what a node would train: its "training" is a site round (`SiteCoordinator`)
and its update the round's partial, claiming the sum of the site's accepted sample counts. It
announces the site's capacity (the samples of every node the site has heard of) while at least
`min_live` site nodes are live, and offline otherwise, so that upstream selects it only when it
can answer.

With several workers for one site (`share_group`), each subscribes to the site's task topic through
an MQTT v5 shared subscription (``$share/GROUP/...``): the broker hands each task to one live worker,
so they share the rounds, and when one dies the others take its share. A worker that sees the site
announced offline while it is alive (a dead worker's will) announces it online again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import torch

from fedmq.aggregator.site import SiteCoordinator
from fedmq.broker import BusConfig, Message
from fedmq.fedcore.algorithms.base import NodeHalf, Payload
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.protocol import Announcement, CoordinatorStatus, RunState
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon, NoUpdate, Task
from fedmq.fednode.workspace import Workspace

logger = logging.getLogger(__name__)


def no_data() -> TensorDataset:
    """An aggregator holds no data of its own (its announcement and updates count its site's)."""
    return TensorDataset(torch.zeros(0), torch.zeros(0, dtype=torch.long), num_classes=1)


class UpstreamNode(NodeDaemon):
    """The node daemon whose training is its site's round (`SiteCoordinator.request`)."""

    def __init__(
        self,
        config: NodeConfig,
        bus_config: BusConfig,
        half: NodeHalf,
        workspace: Workspace,
        site: SiteCoordinator,
        *,
        min_live: int = 1,
        share_group: str | None = None,
    ) -> None:
        super().__init__(config, bus_config, half, no_data(), workspace)
        self.site = site
        self.min_live = min_live
        self.share_group = share_group
        self._announced: tuple[bool, int] | None = None
        self._was_ready = False
        self.partials_sent = 0
        self.upstream_state = RunState.STOPPED
        """How upstream's run ended, as its last status said (the site's run ends the same way)."""

    @property
    def ready(self) -> bool:
        """Whether upstream should select this aggregator: `min_live` of its site's nodes are live, the
        first time; afterwards, any (a site that lost some nodes still answers with the others)."""
        if self.site.live >= (1 if self._was_ready else self.min_live):
            self._was_ready = True
        return self._was_ready and self.site.live > 0

    def site_changed(self) -> None:
        """The site's liveness or capacity may have changed: announce again when what upstream sees differs
        (before the first subscription, the on-connect announcement will say it, once tasks can arrive)."""
        subscribed = self._subscribed.is_set() and self.bus is not None and self.bus.connected
        if self._announced != (self.ready, self.site.capacity) and subscribed:
            self._spawn(self._announce(), f"announce-{self.node_id}")

    def _subscriptions(self) -> list[str]:
        topics = super()._subscriptions()
        if self.share_group is not None:
            task = self.topics.task(self.node_id)
            topics = [f"$share/{self.share_group}/{task}" if t == task else t for t in topics]
            topics.append(self.topics.node_status(self.node_id))  # a dead worker's will, to answer
        return topics

    def _announcement(self, online: bool) -> Announcement:
        """The site's: online only while it can answer, claiming its capacity, with its live nodes."""
        online = online and self.ready
        announcement = super()._announcement(online)
        if online:
            announcement = dataclasses.replace(
                announcement,
                num_samples=self.site.capacity,
                site_live=self.site.live,
                label_histogram=None,
                # workers sharing one node id count their connections apart: none of them can say the
                # node reconnected, which would have the coordinator send its task in hand again
                connection=None if self.share_group is not None else announcement.connection,
            )
        self._announced = (online, self.site.capacity)
        return announcement

    async def _dispatch(self, envelope: Any) -> None:
        route = self.topics.route(envelope.topic)
        if route is not None and route.channel == "node-status" and route.node == self.node_id:
            offline = envelope.message.meta.get("state") == "offline"
            alive = self.draining is None and not self.crashed
            if self.share_group is not None and offline and alive and self.ready:
                logger.info("%s: another worker went offline; announcing the site again", self.node_id)
                self._spawn(self._announce(), f"announce-{self.node_id}")
            return
        await super()._dispatch(envelope)

    def _on_coordinator_status(self, message: Message) -> None:
        super()._on_coordinator_status(message)
        status = CoordinatorStatus.from_meta(message.meta)
        if status.state.final and status.run_id == self._run_id:
            self.upstream_state = status.state

    async def _produce(self, task: Task, payload: Payload) -> tuple[bytearray, float]:
        """A site round on upstream's model; its partial, encoded as this node's update."""
        started = time.perf_counter()
        partial = await self.site.request(task.round, task.attempt, task.settings.to_meta(), payload)
        if partial is None:
            raise NoUpdate(f"no update from the site's nodes in round {task.round} ({self.site.live} live)")
        frame = await asyncio.to_thread(
            self._encode,
            task,
            partial.payload,
            partial.train_seconds,
            num_samples=partial.num_samples,
            site_nodes=len(partial.nodes),
        )
        self.partials_sent += 1
        return frame, time.perf_counter() - started
