"""`fedmq node`: node daemons, one per --node-id, in this process, with their Prometheus metrics
(`--metrics`) for as long as they serve."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fedmq.experiments.broker_flags import add_access, add_broker, broker_access
from fedmq.experiments.cli import daemon
from fedmq.experiments.cli.exits import EXIT_BUS, EXIT_OK
from fedmq.experiments.cli.options import add_experiment, add_federation, add_threads, device, http_address
from fedmq.fedcore.errors import ConfigError

HELP = "run node daemon(s)"
DESCRIPTION = (
    "One node daemon per --node-id, all in this process (one MQTT connection each, one"
    " shared dataset load, training one at a time). In an experiment a node takes its shard of the partition;"
    " with --data, a deployed node trains on its own data instead and the dataset is never loaded."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_broker(p)
    p.add_argument(
        "--node-id",
        dest="node_ids",
        action="append",
        required=True,
        metavar="ID",
        help="node id, e.g. node-003 (repeatable; 'all' hosts every node of the experiment)",
    )
    add_experiment(p)
    add_federation(p)
    p.add_argument("--exit-when-done", action="store_true", help="exit when the coordinator finishes the run")
    daemon.add_service(p)
    add_threads(p)
    p.add_argument("--device", type=device, help="torch device (default: cuda when present, else cpu)")
    p.add_argument(
        "--data",
        type=Path,
        metavar="PATH",
        help="this node's own data: an .npz of x and y, or a folder PATH/<class index>/*.png (one --node-id;"
        " docs/local-data.md)",
    )
    p.add_argument(
        "--metrics",
        type=http_address,
        metavar="[HOST:]PORT",
        help="serve Prometheus metrics of this process's nodes at http://HOST:PORT/metrics (a bare port listens on"
        " loopback only; 0 picks a free port, printed at start; docs/metrics.md)",
    )
    add_access(p)


def run(args: argparse.Namespace) -> int:
    return daemon.serve(_serve, args)


async def _serve(args: argparse.Namespace, signals: Any) -> int:
    import torch

    from fedmq.broker.tuning import tune_process
    from fedmq.experiments.build import build_nodes
    from fedmq.experiments.service import nodes_status
    from fedmq.fednode.daemon import serve_nodes

    cfg, notifier = daemon.start(args, signals)
    ids = cfg.node_ids() if args.node_ids == ["all"] else args.node_ids
    daemons = build_nodes(
        cfg,
        args.broker,
        ids,
        federation=args.federation,
        exit_when_done=args.exit_when_done,
        device=torch.device(args.device) if args.device else None,
        data_path=args.data,
        access=broker_access(args),
    )
    tune_process(daemons[0].bus_config)  # the process's, shared by its nodes' clients
    await daemon.wait_for_broker(args, cfg, notifier)  # after what can be checked here: a mistake is said at once

    def drain() -> None:  # until here SIGTERM just stops
        for node in daemons:
            node.drain("SIGTERM")

    signals.drain = drain
    async with (
        _metrics(args, daemons),
        notifier.running([d.connected for d in daemons], lambda: nodes_status(daemons)),
    ):
        failed = await serve_nodes(daemons)
    if failed:
        print(f"fedmq node: {len(failed)} of {len(daemons)} node(s) stopped on a broker error: {', '.join(failed)}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BUS
    return EXIT_OK


@contextlib.asynccontextmanager
async def _metrics(args: argparse.Namespace, daemons: list[Any]) -> AsyncIterator[None]:
    """Prometheus /metrics of the node daemons (`--metrics`) for as long as they serve."""
    if args.metrics is None:
        yield
        return
    from fedmq.fednode.metrics import NodeHostMetrics, serve_metrics

    host, port = args.metrics
    async with contextlib.AsyncExitStack() as stack:
        try:
            url = await stack.enter_async_context(serve_metrics(NodeHostMetrics(daemons).render, host, port))
        except OSError as exc:
            raise ConfigError(f"--metrics {host}:{port}: cannot listen there: {exc.strerror or exc}") from exc
        print(f"metrics: {url}/metrics", file=sys.stderr, flush=True)
        yield
