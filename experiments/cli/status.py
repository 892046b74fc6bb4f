"""`fedmq status`: a running coordinator's state, read from its HTTP API (`experiments.status`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedmq.experiments.cli.exits import EXIT_BUS, EXIT_OK
from fedmq.experiments.cli.options import positive_int
from fedmq.fedcore.errors import ConfigError

HELP = "a running coordinator's state, from its HTTP API"
DESCRIPTION = (
    "Prints what the dashboard shows: the state, the round or model version, accuracy, the last"
    " rounds and the nodes, from a coordinator started with --http. Exit 0, 2 when the token is missing or"
    " wrong, 3 when nothing answers."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="URL|RUN_DIR", help="http://HOST:PORT/, or a run directory with http.json")
    p.add_argument("--token-file", type=Path, metavar="FILE", help="the bearer token, if the API wants one")
    p.add_argument("--json", action="store_true", help="print the raw state as JSON instead of tables")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until the run ends")
    p.add_argument("--last", type=positive_int, default=10, help="rounds shown (default 10)")


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from rich.console import Console

    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.observers.http import read_token
    from fedmq.experiments.status import Unreachable, render, resolve_url, snapshot

    try:
        token = read_token(args.token_file) if args.token_file else None
    except CoordinatorError as exc:
        raise ConfigError(str(exc)) from exc
    url = resolve_url(args.target)
    console = Console(highlight=False)
    seen = False
    while True:
        try:
            state = snapshot(url, token)
        except Unreachable as exc:
            if not seen:
                print(f"fedmq status: {exc}", file=sys.stderr)
                return EXIT_BUS
            # a daemon exits when its run is over: after answering, silence is the end, not a fault
            print(f"fedmq status: {url} stopped answering: the coordinator has exited", file=sys.stderr)
            return EXIT_OK
        seen = True
        if args.json:
            print(json.dumps(state, indent=2))
        else:
            if args.watch:
                console.clear()
            render(state, console, args.last)
        if not args.watch or state["status"]["state"] in ("finished", "failed", "stopped"):
            return EXIT_OK
        time.sleep(args.watch)
