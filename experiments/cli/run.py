"""`fedmq run`: a whole federation on this machine (the work is `experiments.runner`'s)."""

from __future__ import annotations

import argparse

from fedmq.experiments.broker_flags import add_access, add_broker
from fedmq.experiments.cli.loop import run_async
from fedmq.experiments.cli.options import add_experiment, add_http, add_out

HELP = "run a whole federation on this machine"
DESCRIPTION = (
    "Start a broker (the embedded one unless --broker is given), the coordinator and the nodes as"
    " separate processes; show progress; write the results to the run directory."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_experiment(p, positional=True)
    add_out(p, "run directory (default: runs/NAME-TIMESTAMP)")
    add_broker(p, "use this broker, e.g. mqtt://127.0.0.1:1883, instead of starting one", required=False)
    p.add_argument("--processes", type=int, help="node-host processes (default: hosting.processes or the core count)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    p.add_argument(
        "--secure",
        action="store_true",
        help="provision the federation (OUT/secure: a CA, a password per node, ACLs) and run it over TLS on a"
        " broker started for it (mosquitto when installed, else the embedded one), no anonymous access",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="the coordinator also writes TensorBoard scalars to OUT/tensorboard (each grid cell's to its own;"
        " needs pip install 'fedmq[tensorboard]')",
    )
    add_http(p)
    add_access(p)


def run(args: argparse.Namespace) -> int:
    from fedmq.experiments.runner import run_from_cli

    return run_async(run_from_cli(args))
