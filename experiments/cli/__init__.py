"""The `fedmq` command: broker, coordinator, node and run.

Exit codes: 0 success, 2 invalid configuration or arguments, 3 broker unreachable, 4 the federation
failed (no nodes, no progress), 5 a replay differs from its recorded run, 130 interrupted
(`cli.exits`, which also says which error is which).

Each command is a module of this package that declares what `fedmq --help` says of it (`HELP`,
`DESCRIPTION`), `add_arguments(p)`, its own options, and `run(args) -> int`, its handler (`Command`);
`COMMANDS` names them, in the order `fedmq --help` lists them. `build_parser` makes each one's
subparser from its declaration and adds the logging options every command takes, so that no module
repeats how a subparser is made. What several commands share: `cli.options` (logging, the
experiment file, `--out`, HTTP), `cli.daemon` (the daemons' service options and signals),
`experiments.broker_flags` (`--broker` and its access).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Protocol

from fedmq.experiments.cli import (
    aggregator,
    bench,
    broker,
    coordinator,
    methods,
    node,
    provision,
    replay,
    report,
    run,
    simulate,
    status,
)
from fedmq.experiments.cli.exits import (
    EXIT_BUS,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_OK,
    exit_for,
)
from fedmq.experiments.cli.loop import event_loop_factory
from fedmq.experiments.cli.options import add_common
from fedmq.experiments.service import die_with_parent

__all__ = [
    "COMMANDS",
    "EXIT_BUS",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_MISMATCH",
    "EXIT_OK",
    "build_parser",
    "event_loop_factory",
    "main",
]

DESCRIPTION = """\
fedmq: event-driven federated learning over MQTT.

  fedmq run EXP.yaml                 run a federation (or every cell of a grid) on this machine
  fedmq broker                       run a development broker (mosquitto if installed, else embedded)
  fedmq coordinator --broker URL --config EXP.yaml    the server daemon
  fedmq node --broker URL --config EXP.yaml --node-id node-000    a node daemon
  fedmq aggregator --broker URL --config EXP.yaml --site site-0   a site aggregator (hierarchy.sites)
  fedmq status URL|RUN_DIR           a running coordinator's state, from its HTTP API
  fedmq report RUN_DIR               rebuild the tables and plots of a run from its saved metrics
  fedmq replay RUN_DIR [--set K=V]   replay a recorded run in process and check every model hash
                                     (with --set: the same availability and timing, something changed)
  fedmq simulate EXP.yaml [--scenario FILE]    the federation in one process on a virtual clock
  fedmq methods [NAME]               the methods, and each one's hyperparameters with their defaults
  fedmq bench [SUITE ...|all]        the benchmark suite: codec, transport, rounds, flower, scale, hierarchy,
                                     train, sim, async, node, fedsa, teacher, secure
  fedmq provision --config EXP.yaml OUT_DIR    the CA, certificates, credentials and broker configs
                                               of a secure federation

Start with:  fedmq run experiments/quickstart.yaml
"""


class Command(Protocol):
    """What a command module declares; its name is its key in `COMMANDS`. `HELP` is its line in
    `fedmq --help`, `DESCRIPTION` heads its own --help: wrapped to the terminal, unless it has line
    breaks, which it then keeps (`_formatter`)."""

    HELP: str
    DESCRIPTION: str

    def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: dict[str, Command] = {
    "run": run,
    "status": status,
    "report": report,
    "replay": replay,
    "simulate": simulate,
    "methods": methods,
    "bench": bench,
    "broker": broker,
    "provision": provision,
    "coordinator": coordinator,
    "node": node,
    "aggregator": aggregator,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedmq", description=DESCRIPTION, formatter_class=_formatter(DESCRIPTION))
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = subparsers.add_parser(
            name, help=command.HELP, description=command.DESCRIPTION, formatter_class=_formatter(command.DESCRIPTION)
        )
        command.add_arguments(p)
        add_common(p)  # the logging options, which `main` reads whatever the command, last in every --help
    return parser


def _formatter(description: str) -> type[argparse.HelpFormatter]:
    """A description with line breaks is laid out by hand (examples, a table): argparse keeps its
    lines. Any other it wraps to the terminal, as it would have run the lines together anyway."""
    return argparse.RawDescriptionHelpFormatter if "\n" in description else argparse.HelpFormatter


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    die_with_parent()
    from fedmq.experiments import logs

    if args.log_format == "json":
        os.environ["FEDMQ_LOG_FORMAT"] = "json"  # the processes `fedmq run` starts log alike
    try:
        # `fedmq run` shows its own progress: its log reaches the console only with -v
        logs.setup(
            args.verbose,
            file=args.log_file,
            console=args.command != "run" or bool(args.verbose),
            config_file=args.log_config,
            fmt=args.log_format,
        )
        return COMMANDS[args.command].run(args)
    except BaseException as exc:  # the errors of exits.py, each one line and its exit code; others go on
        known = exit_for(exc)
        if known is None:
            raise
        code, text = known
        if text is not None:
            print(logs.line(text, args.log_format), file=sys.stderr, flush=True)
        return code
