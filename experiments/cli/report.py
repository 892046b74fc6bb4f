"""`fedmq report`: a run's report rebuilt from its saved metrics (`experiments.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedmq.experiments.cli.exits import EXIT_OK
from fedmq.fedcore.errors import ConfigError

HELP = "rebuild a run's report from its saved metrics"
DESCRIPTION = (
    "Write report.md (accuracy tables as mean +- std over seeds, rounds to the target, the"
    " paper's figures beside ours), report.json and the accuracy curves (PNG) into RUN_DIR, from the"
    " metrics saved there. Works on a grid's directory and on a single run's."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a directory written by `fedmq run`")
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNG curves")


def run(args: argparse.Namespace) -> int:
    from fedmq.experiments.report import write_report

    if not args.run_dir.is_dir():
        raise ConfigError(f"{args.run_dir} is not a directory; give the --out of a `fedmq run`")
    try:
        path = write_report(args.run_dir, plots=not args.no_plots)
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    print(f"report written: {path}")
    return EXIT_OK
