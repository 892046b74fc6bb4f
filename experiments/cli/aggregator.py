"""`fedmq aggregator`: one site of a hierarchical federation, the coordinator of its nodes and one
node upstream (`aggregator.site`, docs/hierarchy.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fedmq.experiments.broker_flags import add_broker
from fedmq.experiments.cli import daemon
from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.cli.options import add_experiment, add_federation, add_out, add_threads

HELP = "run a site aggregator daemon (hierarchical federations)"
DESCRIPTION = (
    "One site of an experiment with hierarchy.sites: the coordinator of the site's nodes (on"
    " --broker, the site's broker, federation FED.SITE) and, upstream, one node of the federation (node id"
    " SITE) that sends one partial update a round for all of them. By default upstream is reached through"
    " --broker, bridged to the central broker (`fedmq broker --bridge`); --upstream connects directly."
    " Only methods whose aggregation splits into parts run this way (FedAvg and the methods that reuse its"
    " server); docs/hierarchy.md.\n\n"
    "  fedmq broker --port 1884 --bridge mqtt://central:1883 --federation FED --site site-0\n"
    "  fedmq aggregator --broker mqtt://127.0.0.1:1884 --site site-0 --config EXP.yaml --federation FED\n"
    "  fedmq node --broker mqtt://127.0.0.1:1884 --federation FED.site-0 --node-id node-000 ..."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_broker(p, "the site's broker, where its nodes are")
    p.add_argument("--site", required=True, metavar="SITE", help="the site, e.g. site-0 (hierarchy.sites names them)")
    add_experiment(p)
    p.add_argument("--upstream", metavar="URL", help="reach the coordinator's broker directly, not through the bridge")
    add_federation(p)
    p.add_argument(
        "--worker",
        type=int,
        default=0,
        metavar="N",
        help="this process's number among the site's hierarchy.workers (0 ..), which share the site's rounds",
    )
    add_out(p, "the site's run directory (default runs/SITE)")
    p.add_argument("--exit-when-done", action="store_true", help="exit when the coordinator finishes the run")
    daemon.add_service(p)
    add_threads(p)


def run(args: argparse.Namespace) -> int:
    return daemon.serve(_serve, args)


async def _serve(args: argparse.Namespace, signals: Any) -> int:
    from fedmq.broker.tuning import tune_process
    from fedmq.experiments.build import build_site_aggregator

    cfg, notifier = daemon.start(args, signals)
    aggregator = build_site_aggregator(
        cfg,
        args.broker,
        args.site,
        args.out or Path("runs") / args.site,
        federation=args.federation,
        upstream_url=args.upstream,
        worker=args.worker,
        exit_when_done=args.exit_when_done,
    )
    tune_process(aggregator.site.bus_config)
    await daemon.wait_for_broker(args, cfg, notifier)
    signals.drain = lambda: aggregator.drain("SIGTERM")
    connected = [aggregator.site.connected, aggregator.upstream.connected]
    async with notifier.running(connected, lambda: f"site {args.site}: {aggregator.site.live} nodes live"):
        state = await aggregator.serve()
    return EXIT_OK if state in ("finished", "stopped") else EXIT_FAILED
