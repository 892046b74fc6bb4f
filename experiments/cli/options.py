"""The options several commands share, declared once so that they read alike everywhere, with the
argument types that check them as they are parsed, and what reads some of them back."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# -- argument types ----------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def device(text: str) -> str:
    """A torch device name, checked without importing torch here: cpu, cuda, cuda:N, mps."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device (cpu, cuda, cuda:1, mps)")
    return text


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text}")
    return value


def http_address(text: str) -> tuple[str, int]:
    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.observers.http import parse_address

    try:
        return parse_address(text)
    except CoordinatorError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


# -- option groups -----------------------------------------------------------------------------------


def add_common(p: argparse.ArgumentParser) -> None:
    """Logging, which every command takes, last: `build_parser` adds it to each, as `main` reads it
    before the command runs."""
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    p.add_argument("--log-file", type=Path, help="also write the log to this file")
    p.add_argument("--log-config", type=Path, help="a logging dictConfig YAML file, replacing the defaults")
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=os.environ.get("FEDMQ_LOG_FORMAT") or "text",
        help="text (default), or json: one JSON object a line (time, level, logger, message, process, exception);"
        " FEDMQ_LOG_FORMAT sets the default, and processes `fedmq run` starts inherit it",
    )


def add_experiment(p: argparse.ArgumentParser, *, positional: bool = False) -> None:
    """The experiment file and `--set`, read back by `experiment(args)`."""
    if positional:
        p.add_argument("config", type=Path, metavar="EXP.yaml", help="the experiment file")
    else:
        p.add_argument("--config", required=True, type=Path, metavar="EXP.yaml", help="the experiment file")
    add_overrides(p, "override a config field, e.g. --set rounds=5 --set train.lr=0.1 (repeatable)")


def add_overrides(p: argparse.ArgumentParser, help: str) -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`: the experiment's (`add_experiment`), or
    the change a counterfactual replay makes; each says which."""
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def experiment(args: argparse.Namespace) -> Any:
    """The experiment `add_experiment`'s options name: the file, with `--set` applied."""
    from fedmq.experiments.config import load_config

    return load_config(args.config, args.overrides)


def add_out(p: argparse.ArgumentParser, help: str, default: Path | None = None) -> None:
    """`--out`, the run directory a command writes; each says its own default."""
    p.add_argument("--out", type=Path, default=default, help=help)


def add_federation(p: argparse.ArgumentParser) -> None:
    p.add_argument("--federation", help="topic namespace (default: the config's federation or name)")


def add_threads(p: argparse.ArgumentParser, help: str = "torch threads", default: int | None = None) -> None:
    p.add_argument("--threads", type=positive_int, default=default, help=help)


def set_threads(n: int | None) -> None:
    """`--threads`: torch's intra-op threads, when given."""
    if n:
        import torch

        torch.set_num_threads(n)


def add_http(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP API and dashboard")
    g.add_argument(
        "--http",
        type=http_address,
        metavar="[HOST:]PORT",
        help="serve the JSON API, /metrics and a live dashboard on this address (off by default; a bare port"
        " listens on loopback only; 0 picks a free port, written to OUT/http.json)",
    )
    g.add_argument(
        "--http-token-file",
        type=Path,
        metavar="FILE",
        help="require this bearer token (the file's first line, 16 characters or more) on every endpoint but"
        " /healthz and /readyz; a browser opens /?token=TOKEN once and keeps it in an HttpOnly cookie",
    )
