"""`fedmq provision`: what a secure federation needs (CA, certificates, credentials, broker configs),
written by `broker.servers.provision` for the experiment's nodes."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedmq.experiments.cli.exits import EXIT_OK
from fedmq.experiments.cli.options import add_experiment, add_federation, experiment, positive_int
from fedmq.fedcore.errors import ConfigError

HELP = "write what a secure federation needs: CA, broker certificate, credentials, broker configs"
DESCRIPTION = (
    "Write into OUT_DIR (which must be new or empty): a CA and a broker certificate for --host, one"
    " credentials file per identity (the coordinator, the run monitor, each node of the experiment), and a"
    " mosquitto config (and the embedded broker's) with TLS, no anonymous access, persistence, and an ACL in"
    " which each node publishes only on its own topics and reads only its own tasks, the model broadcasts and"
    " the coordinator's state.\n\n"
    "  fedmq provision secure/ --config EXP.yaml --host broker.example.org\n"
    "  fedmq broker --secure secure/\n"
    "  fedmq coordinator --broker mqtts://broker.example.org:8883 --credentials secure/credentials ...\n"
    "  fedmq node --broker mqtts://broker.example.org:8883 --credentials node-003.json --node-id node-003 ..."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, metavar="OUT_DIR", help="where to write (new or empty)")
    add_experiment(p)
    add_federation(p)
    p.add_argument(
        "--host",
        dest="hosts",
        action="append",
        metavar="NAME",
        help="a host name or address the broker is reached by, for its certificate (repeatable; default"
        " localhost and 127.0.0.1)",
    )
    p.add_argument("--port", type=int, default=8883, help="the broker's TLS port (default 8883)")
    p.add_argument("--bind", default="127.0.0.1", help="the address the broker listens on (default 127.0.0.1)")
    p.add_argument("--days", type=positive_int, default=365, help="certificate lifetime in days (default 365)")


def run(args: argparse.Namespace) -> int:
    from fedmq.broker.servers.provision import DEFAULT_HOSTS, provision
    from fedmq.experiments.build import federation_id

    cfg = experiment(args)
    try:
        result = provision(
            args.out,
            federation=args.federation or federation_id(cfg),
            nodes=cfg.node_ids(),
            hosts=args.hosts or DEFAULT_HOSTS,
            port=args.port,
            bind=args.bind,
            days=args.days,
        )
    except (ValueError, FileExistsError) as exc:
        raise ConfigError(str(exc)) from None
    print(f"provisioned federation {result.federation!r} ({len(result.nodes)} nodes) in {result.directory}")
    print((result.directory / "README.txt").read_text().split("\n\n", 1)[1], end="")
    return EXIT_OK
