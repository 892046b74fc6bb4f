"""One site aggregator: its upstream node and its site coordinator, served together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fedmq.aggregator.site import SiteCoordinator
from fedmq.aggregator.upstream import SiteTrainer
from fedmq.coordinator.engine import events as e
from fedmq.fedcore.protocol import RunState
from fedmq.fednode.daemon import NodeDaemon

logger = logging.getLogger(__name__)


class SiteAggregator:
    """Serves the site first (its nodes' statuses make the upstream announcement), then upstream; when
    upstream's run ends (or a drain or cancellation stops upstream), the site's run ends the same way."""

    def __init__(self, upstream: NodeDaemon, trainer: SiteTrainer, site: SiteCoordinator) -> None:
        """`upstream` is the node daemon whose updates `trainer` makes from `site`'s rounds."""
        self.upstream = upstream
        self.trainer = trainer
        self.site = site
        site.watchers.append(self._watch)

    @property
    def name(self) -> str:
        return self.upstream.node_id

    def _watch(self, now: float, event: e.Event, commands: Any) -> None:
        if isinstance(event, e.NodeSeen) and self.trainer.changed:
            self.upstream.presence.announce_soon()  # the site's liveness or capacity changed what upstream sees

    def drain(self, reason: str) -> None:
        """Finish the site round in hand, send its partial, then stop (upstream and site)."""
        self.upstream.drain(reason)

    async def serve(self) -> str:
        """Run until upstream's run ends (with `exit_when_done`), a drain, or cancellation; returns the
        state the site's run ended in."""
        site = asyncio.create_task(self.site.serve(), name=f"site-{self.name}")
        connected = asyncio.create_task(self.site.connected.wait())
        try:
            await asyncio.wait({site, connected}, return_when=asyncio.FIRST_COMPLETED)
            if site.done():
                site.result()  # a site that could not start (its broker) ends the aggregator with the reason
                return RunState.FAILED
            await self.upstream.serve()
            self.site.finish(self.upstream.run_outcome if self.upstream.draining is None else RunState.STOPPED)
            summary = await site
            return summary.state
        finally:
            connected.cancel()
            if not site.done():
                site.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await site
