"""What the daemon commands (coordinator, node, aggregator) share: the service options, how they are
run under a supervisor (SIGTERM drains, SIGINT interrupts), and the wait for their broker."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Coroutine
from typing import Any

from fedmq.experiments.cli.exits import EXIT_INTERRUPTED
from fedmq.experiments.cli.loop import run_async
from fedmq.experiments.cli.options import seconds

Daemon = Callable[[argparse.Namespace, Any], Coroutine[Any, Any, int]]


def add_service(p: argparse.ArgumentParser) -> None:
    """A daemon's life under a supervisor: how long it waits for its broker (`wait_for_broker`), how
    long a drain may take (`serve`)."""
    g = p.add_argument_group(
        "service",
        "As a daemon under systemd, Docker or another supervisor (docs/services.md): with $NOTIFY_SOCKET set it"
        " tells systemd when it is ready, its status and watchdog pings. SIGTERM drains and exits 0; SIGINT"
        " exits 130.",
    )
    g.add_argument(
        "--connect-timeout",
        type=seconds,
        default=10.0,
        metavar="SECONDS",
        help="at start, wait up to SECONDS for an unreachable broker, retrying with exponential backoff and"
        " jitter, then exit 3 (default 10; 0 tries once; the systemd units wait 300)",
    )
    g.add_argument(
        "--drain-timeout",
        type=seconds,
        default=60.0,
        metavar="SECONDS",
        help="on SIGTERM, the longest the drain may take before the process stops at once with exit 130"
        " (default 60; a second SIGTERM also stops at once)",
    )


def serve(command: Daemon, args: argparse.Namespace) -> int:
    """A daemon command: SIGTERM drains it (exit 0), SIGINT interrupts it (130); `experiments.service`."""
    from fedmq.experiments.service import Signals

    signals = Signals(drains=True, drain_s=args.drain_timeout, forced_exit=EXIT_INTERRUPTED)
    return run_async(command(args, signals), signals)


def start(args: argparse.Namespace, signals: Any) -> tuple[Any, Any]:
    """What every daemon does first: load its experiment (a mistake exits 2 here), make the notifier a
    stop signal reaches (systemd's status), and set its threads. Returns (the experiment, the notifier)."""
    from fedmq.experiments.cli.options import experiment, set_threads
    from fedmq.experiments.service import Notifier

    cfg = experiment(args)
    notifier = Notifier()
    signals.on_stop = notifier.stopping
    set_threads(args.threads)
    return cfg, notifier


async def wait_for_broker(args: argparse.Namespace, cfg: Any, notifier: Any) -> None:
    """`--connect-timeout`: once what can be checked locally is (config, data, node ids: exit 2), a
    daemon waits for its broker, and exits 3 naming it if it does not come."""
    from fedmq.experiments.build import bus_config
    from fedmq.experiments.service import wait_for_broker as wait

    config = bus_config(cfg, args.broker)
    notifier.status(f"connecting to the broker {config.url}")
    await wait(
        config,
        args.connect_timeout,
        on_retry=lambda n, why: notifier.status(f"waiting for the broker {config.url} ({why}; attempt {n})"),
    )
