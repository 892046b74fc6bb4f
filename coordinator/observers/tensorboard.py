"""TensorBoard scalars from the coordinator (`fedmq coordinator --tensorboard`), when tensorboard is installed.

A watcher (`Coordinator.watchers`) that writes each metrics line (`c.Record`) as scalars through
torch's `SummaryWriter`: the x axis is the round (sync) or the model version (async), so a
TensorBoard of several runs lines them up as the report's curves do. It writes what the line says
and nothing else: the metrics lines stay the record of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.fedcore.errors import ConfigError

INSTALL_HINT = "pip install 'fedmq[tensorboard]'"

COUNTED = {
    "selected": "nodes/selected",
    "accepted": "updates/accepted",
    "folded": "updates/accepted",
    "carried": "updates/carried",
    "late": "updates/late",
    "late_folded": "updates/late_folded",
    "stale": "updates/stale",
    "expired": "updates/expired",
    "lost": "updates/lost",
    "rejected": "updates/rejected",
    "failed": "updates/failed",
}
"""Lists (sync) and counts (async) of the metrics lines -> their scalar's tag (a list gives its length)."""
NAMED = {"live": "nodes/live", "in_flight": "nodes/in_flight", "buffered": "updates/buffered"}
SKIPPED = frozenset({"round", "attempt", "version", "model_version", "ended_s", "aggregated", "flush"})
"""Bookkeeping, not a curve (the step is the round or the version)."""


def check_installed() -> None:
    """ConfigError (exit 2) saying how to install it, when tensorboard is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(f"--tensorboard needs the tensorboard package: {INSTALL_HINT}") from None


class TensorBoardScalars:
    """Writes every metrics line to a TensorBoard log in `log_dir`; `close()` at the end of the run."""

    def __init__(self, log_dir: Path) -> None:
        check_installed()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def __call__(self, now: float, event: e.Event, commands: list[c.Command]) -> None:
        for command in commands:
            if isinstance(command, c.Record):
                self.write(command.record)
            elif isinstance(command, c.Finish):
                self.writer.flush()

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["version"] if "version" in record else record["round"])
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars a metrics line gives, by tag: counts of nodes by outcome, and every number it holds."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in SKIPPED or isinstance(value, bool):
            continue
        if key in COUNTED and isinstance(value, list | int):
            out[COUNTED[key]] = float(len(value) if isinstance(value, list) else value)
        elif isinstance(value, int | float):
            out[NAMED.get(key, key)] = float(value)
    return out
