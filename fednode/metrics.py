"""Prometheus metrics of a node host: the node daemons of one `fedmq node` process (`docs/metrics.md`).

Everything is read from the daemons when Prometheus scrapes (their counters, their scenario
players', their bus clients'), so the daemons do no bookkeeping for it. A host may carry thousands
of nodes, so most series are the host's sums; only three are per node (label `node`): tasks
received, updates sent and whether it is connected, the figures that show which node stalls.
`serve_metrics` serves `/metrics` from a small aiohttp server on the daemons' event loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fedmq.broker.prometheus import bus_families
from fedmq.fednode.daemon import NodeDaemon

logger = logging.getLogger(__name__)


class NodeHostMetrics:
    """The metrics of `daemons` (one process's), in a registry of their own."""

    def __init__(self, daemons: Sequence[NodeDaemon]) -> None:
        self.daemons = list(daemons)
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_HostCollector(self.daemons))

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _HostCollector:
    def __init__(self, daemons: list[NodeDaemon]) -> None:
        self.daemons = daemons

    def collect(self) -> Iterator[Metric]:
        daemons = self.daemons
        connected = [d.bus is not None and d.bus.connected for d in daemons]
        received = CounterMetricFamily(
            "fedmq_node_tasks_received",
            "Valid tasks the node received (malformed or expired ones are in fedmq_rejected_messages_total).",
            labels=["node"],
        )
        sent = CounterMetricFamily("fedmq_node_updates_sent", "Updates the node published.", labels=["node"])
        up = GaugeMetricFamily("fedmq_node_connected", "1 while the node is connected to the broker.", labels=["node"])
        for daemon, is_up in zip(daemons, connected, strict=True):
            player = daemon.player
            received.add_metric([daemon.node_id], player.tasks_received + player.ignored_offline)
            sent.add_metric([daemon.node_id], daemon.updates.sent)
            up.add_metric([daemon.node_id], int(is_up))
        yield from (received, sent, up)
        yield GaugeMetricFamily("fedmq_host_nodes", "Node daemons in this process.", value=len(daemons))
        yield GaugeMetricFamily(
            "fedmq_host_nodes_online",
            "Nodes connected and online by their scenario (a scripted offline node stays connected).",
            value=sum(1 for d, is_up in zip(daemons, connected, strict=True) if is_up and d.player.online),
        )
        abandoned = CounterMetricFamily(
            "fedmq_host_tasks_abandoned",
            "Tasks the nodes did not train or whose update they did not send, by reason: dropped (the scenario"
            " drops it), offline (it came while the node was scripted offline), went_offline (the node went"
            " offline before sending the update). Training errors are in fedmq_rejected_messages_total.",
            labels=["reason"],
        )
        for reason, attr in (("dropped", "dropped"), ("offline", "ignored_offline"), ("went_offline", "abandoned")):
            abandoned.add_metric([reason], sum(getattr(d.player, attr) for d in daemons))
        yield abandoned
        yield CounterMetricFamily(
            "fedmq_host_trainings",
            "Local trainings finished (an update abandoned afterwards included).",
            value=sum(d.updates.trainings for d in daemons),
        )
        yield CounterMetricFamily(
            "fedmq_host_training_seconds",
            "Seconds the nodes spent in local training (wall time of the training call).",
            value=sum(d.updates.train_seconds for d in daemons),
        )
        yield from bus_families(
            [d.bus.stats for d in daemons if d.bus is not None],
            "Messages rejected (malformed, forged, expired tasks, ...) and failed trainings, by reason.",
        )


@contextlib.asynccontextmanager
async def serve_metrics(render: Callable[[], tuple[bytes, str]], host: str, port: int) -> AsyncIterator[str]:
    """Serve `render()` at /metrics on host:port (0: a free port) while the block runs; yields the base URL.
    OSError when the address cannot be bound."""

    async def metrics(_: web.Request) -> web.Response:
        body, content_type = render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1] if runner.addresses else port
        url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        logger.info("metrics at %s/metrics", url)
        yield url
    finally:
        await runner.cleanup()
