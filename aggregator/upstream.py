"""The aggregator's upstream half: one node of the federation that speaks for a site's nodes.

It is the node daemon (announcement, tasks, deadlines, the method check, drain, the update's
publish) assembled with another trainer: what it "trains" is a site round (`SiteCoordinator`) and its
update the round's partial, claiming the sum of the site's accepted sample counts (`SiteTrainer`). It
announces the site's capacity (the samples of every node the site has heard of) while at least
`min_live` site nodes are live, and offline otherwise, so that upstream selects it only when it
can answer.

With several workers for one site (`share_group`), each subscribes to the site's task topic through
an MQTT v5 shared subscription (the node daemon's `share_group`): the broker hands each task to one
live worker, so they share the rounds, and when one dies the others take its share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from fedmq.aggregator.site import SiteCoordinator
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.protocol import Announcement
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.task import Task
from fedmq.fednode.trainer import NoUpdate, Produced, encode_update


def no_data() -> TensorDataset:
    """An aggregator holds no data of its own (its announcement and updates count its site's)."""
    return TensorDataset(torch.zeros(0), torch.zeros(0, dtype=torch.long), num_classes=1)


class SiteTrainer:
    """A site aggregator's trainer: each task is a site round on upstream's model
    (`SiteCoordinator.request`), its update the round's partial."""

    def __init__(self, site: SiteCoordinator, config: NodeConfig, *, min_live: int = 1) -> None:
        self.site = site
        self.config = config
        self.min_live = min_live
        self._announced: tuple[bool, int] | None = None
        self._was_ready = False
        self.partials_sent = 0

    @property
    def ready(self) -> bool:
        """Whether upstream should select this aggregator: `min_live` of its site's nodes are live, the
        first time; afterwards, any (a site that lost some nodes still answers with the others)."""
        if self.site.live >= (1 if self._was_ready else self.min_live):
            self._was_ready = True
        return self._was_ready and self.site.live > 0

    @property
    def changed(self) -> bool:
        """Whether what upstream was last told (ready, capacity) differs from what it would be told now."""
        return self._announced != (self.ready, self.site.capacity)

    def announce(self, announcement: Announcement) -> Announcement:
        """The site's: online only while it can answer, claiming its capacity, with its live nodes."""
        online = announcement.online and self.ready
        if online:
            announcement = dataclasses.replace(
                announcement, num_samples=self.site.capacity, site_live=self.site.live, label_histogram=None
            )
        else:
            announcement = Announcement(online=False)
        self._announced = (online, self.site.capacity)
        return announcement

    def expect(self, task: Task) -> None:
        return None  # a site round starts when the model comes

    def withdraw(self, task: Task) -> None:
        return None

    async def produce(self, task: Task, payload: Payload) -> Produced:
        """A site round on upstream's model; its partial, encoded as this node's update."""
        started = time.perf_counter()
        partial = await self.site.request(task.round, task.attempt, task.settings.to_meta(), payload)
        if partial is None:
            raise NoUpdate(f"no update from the site's nodes in round {task.round} ({self.site.live} live)")
        frame = await asyncio.to_thread(
            encode_update, task, partial.payload, partial.train_seconds, federation=self.config.federation,
            sender=self.config.node_id, num_samples=partial.num_samples, compression=self.config.compression,
            site_nodes=len(partial.nodes),
        )  # fmt: skip
        self.partials_sent += 1
        return frame, time.perf_counter() - started
