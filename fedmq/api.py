"""fedmq's Python API, for notebooks and scripts: what `fedmq simulate`, `fedmq run`, `fedmq replay`
and a run directory give on the command line, as typed calls and objects.

    import fedmq

    cfg = fedmq.load_config("quickstart", rounds=5, train={"lr": 0.05})
    run = fedmq.simulate(cfg, progress=False)
    print(run.final_accuracy, run.metrics[-1]["accuracy"])
    run.replay()                      # every model hash again, or ReplayDiffers

The errors are the command line's, each standing for one exit code (the command line's table of
them is `fedmq.experiments.cli.exits`): `ConfigError`, `DataError`, `CredentialsError` and
`CoordinatorError` (2: the configuration, its data or credentials), `BusError` (3: the broker),
`FederationFailed` (4: the run ended without finishing) and `ReplayDiffers` (5: a replay went
another way than its recorded run).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedmq.broker.errors import BusError
from fedmq.coordinator.drivers.replay import ReplayError
from fedmq.experiments.config import (
    MOVED_TO_POLICY,
    ExperimentConfig,
    key_path,
    merge,
    parse_config,
    read_yaml_sourced,
    set_path,
)
from fedmq.experiments.yaml_source import SourceMap
from fedmq.fedcore.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from matplotlib.figure import Figure

    from fedmq.experiments.replay import Outcome

PathLike = str | os.PathLike[str]
ConfigSource = PathLike | Mapping[str, Any] | ExperimentConfig
"""An experiment file, the name of a shipped one (``quickstart``, ``papers/kdia-table2``), its
contents as a mapping, or a config already loaded."""


class FederationFailed(RuntimeError):
    """The run ended without finishing (no nodes came, too few updates, a timeout): exit code 4.
    `run` is what it left behind, to look at."""

    def __init__(self, run: Run) -> None:
        self.run = run
        reason = run.summary.get("error")
        super().__init__(
            f"the run in {run.directory} ended {run.state}"
            + (f": {reason}" if reason else "")
            + f" (see {run.directory / 'logs'} or its summary.json)"
        )


class ReplayDiffers(ReplayError):
    """A replay went another way than the recorded run: exit code 5. `outcome` says where."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        where = f"at {outcome.mismatch}" if outcome.mismatch is not None else "; ".join(outcome.notes)
        super().__init__(f"the replay differs from the recorded run {where or '(it stopped early)'}")


# -- configuration ----------------------------------------------------------------------------


def load_config(source: ConfigSource, /, **overrides: Any) -> ExperimentConfig:
    """One experiment, validated as `fedmq run` validates it.

    `overrides` change it before validation: a top-level key (``rounds=5``), a section as a mapping
    merged into the file's (``train={"lr": 0.05}``; naming another ``model``, ``method`` or
    ``dataset`` replaces its section whole), or a dotted key (``**{"train.lr": 0.05}``, as ``--set``).
    A file with a grid is for `fedmq run`/`fedmq simulate` (each cell is one experiment)."""
    data, where, sources = _read(source)
    for key, value in overrides.items():
        if "." in key or key in MOVED_TO_POLICY:
            set_path(data, key, value, where=f"override {key}")
        else:
            data = merge(data, {key: value})
        sources = _overridden(sources, key_path(key), value, f"override {key}")
    if "grid" in data or "report" in data:
        raise ConfigError(
            f"{where} declares a grid or a report: run its cells with `fedmq simulate`/`fedmq run` on the"
            " file, or load one cell by overriding the varied keys in a file without the grid"
        )
    return parse_config(data, source=where, sources=sources)


def _overridden(sources: SourceMap, path: tuple[str, ...], value: Any, where: str) -> SourceMap:
    """`sources` after an override: a section given as a mapping is merged, so each of its values is
    the override's (the section's other settings stay where the file wrote them)."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            sources = _overridden(sources, (*path, str(key)), item, where)
        return sources
    return sources.set(path, where)


def _read(source: ConfigSource) -> tuple[dict[str, Any], str, SourceMap]:
    """The experiment's data (a copy), how to name it in errors, and where its values were written."""
    if isinstance(source, ExperimentConfig):
        return source.model_dump(mode="json"), f"config {source.name!r}", SourceMap()
    if isinstance(source, Mapping):
        return json.loads(json.dumps(dict(source), default=str)), "config", SourceMap()
    path = Path(source)
    if not path.exists() and not path.suffix:
        shipped = resources.files("fedmq.experiments").joinpath(f"{source}.yaml")
        if shipped.is_file():
            with resources.as_file(shipped) as file:
                data, sources = read_yaml_sourced(file)
                return data, f"the shipped experiment {source!r}", sources
    data, sources = read_yaml_sourced(path)
    return data, str(path), sources


def _config(source: ConfigSource) -> ExperimentConfig:
    return source if isinstance(source, ExperimentConfig) else load_config(source)


def _default_out(cfg: ExperimentConfig, kind: str) -> Path:
    return Path("runs") / f"{cfg.name}-{kind}{datetime.now().strftime('%Y%m%d-%H%M%S')}"


# -- running ------------------------------------------------------------------------------------


def simulate(
    config: ConfigSource,
    out: PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    resume: bool = False,
    threads: int = 1,
    progress: bool = True,
) -> Run:
    """The federation in this process on a virtual clock (`fedmq simulate`): the same engine, methods
    and run directory as the daemons, so the run replays bit for bit. `out` defaults to
    ``runs/NAME-sim-STAMP``; with `resume`, the run in `out` goes on from its last checkpoint.
    `threads` are torch's (1, as the node hosts train and `replay` replays: sums in one order).
    `progress=False` keeps it silent. Raises `FederationFailed` if it did not finish."""
    import torch
    from rich.console import Console

    from fedmq.experiments.simulate import simulate as simulate_in_process
    from fedmq.fedcore.training import torch_threads

    cfg = _config(config)
    directory = Path(out) if out is not None else _default_out(cfg, "sim-")
    if resume and out is None:
        raise ConfigError("resume=True needs out: the run directory to continue")
    console = Console(stderr=True) if progress else Console(quiet=True)
    chosen = torch.device(device) if isinstance(device, str) else device
    with torch_threads(threads):
        summary = simulate_in_process(cfg, directory, device=chosen, console=console, resume=resume)
    run = open_run(directory)
    if summary.get("state") != "finished":
        raise FederationFailed(run)
    return run


def run(
    config: ConfigSource,
    out: PathLike | None = None,
    *,
    broker: str | None = None,
    processes: int | None = None,
    timeout_s: float | None = None,
    progress: bool = True,
) -> Run:
    """The federation as daemons (`fedmq run`): a broker unless `broker` is given, the coordinator and
    node processes on this machine. Works in a notebook (its event loop keeps running: the run has a
    thread of its own). Raises `FederationFailed` if it did not finish, `BusError` if the broker
    cannot be reached, `ConfigError` if the coordinator refused the configuration."""
    from rich.console import Console

    from fedmq.experiments.report import write_report
    from fedmq.experiments.runner import default_out, run_federation

    cfg = _config(config)
    directory = Path(out) if out is not None else default_out(cfg)
    console = Console(highlight=False) if progress else Console(quiet=True)
    hosts = processes or cfg.hosting.processes or os.cpu_count() or 1
    federation = run_federation(
        cfg, directory, broker=broker, processes=hosts, quiet=not progress, timeout_s=timeout_s, console=console
    )
    code = _in_own_loop(federation)
    if not (directory / "summary.json").exists():
        logs = directory / "logs"
        if code == 2:
            raise ConfigError(f"the coordinator refused the configuration; see {logs / 'coordinator.log'}")
        if code == 3:
            raise BusError(f"the coordinator could not reach the broker; see {logs / 'coordinator.log'}")
    run = open_run(directory)
    if code != 0:
        raise FederationFailed(run)
    write_report(directory)
    return run


def _in_own_loop(coroutine: Any) -> Any:
    """Run `coroutine` to its end: here when no event loop runs, else in a thread (a notebook's loop
    is running, and `asyncio.run` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedmq-run") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def replay(
    directory: PathLike, *, device: str | torch.device | None = None, threads: int = 1, check: bool = True
) -> Outcome:
    """Replay a recorded run in this process and check every model hash (`fedmq replay`). With
    `check`, a replay that differs raises `ReplayDiffers`; a log that cannot be replayed raises
    `ReplayError` either way."""
    import torch

    from fedmq.experiments.replay import replay_run

    chosen = torch.device(device) if isinstance(device, str) else device
    outcome = replay_run(Path(directory), device=chosen, threads=threads)
    if check and not outcome.ok:
        raise ReplayDiffers(outcome)
    return outcome


# -- a run directory -----------------------------------------------------------------------------


def open_run(directory: PathLike) -> Run:
    """A run directory written by `fedmq run`, `fedmq simulate` or the coordinator daemon: finished,
    failed or still running (its files are read when asked for, so a live run shows its progress)."""
    root = Path(directory)
    if not (root / "config.yaml").is_file():
        if (root / "grid.json").is_file():
            cells = sorted(p.parent.name for p in root.glob("*/config.yaml"))
            raise ConfigError(f"{root} is a grid's directory: open one of its cells ({', '.join(cells[:4])}, ...)")
        raise ConfigError(f"{root} is not a run directory (no config.yaml); give the out of a run")
    try:
        data = yaml.safe_load((root / "config.yaml").read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{root / 'config.yaml'} is not valid YAML: {exc}") from None
    return Run(root, parse_config(data, source=str(root / "config.yaml")))


@dataclass(frozen=True)
class Run:
    """A run's directory, read as Python values: its config, per-round metrics, participation record,
    summary and accuracy curves."""

    directory: Path
    config: ExperimentConfig

    @property
    def summary(self) -> dict[str, Any]:
        """summary.json: state, final and best accuracy, counts, timings ({} until the run ends)."""
        path = self.directory / "summary.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    @property
    def state(self) -> str:
        """finished, failed, stopped, or running (no summary yet)."""
        return str(self.summary.get("state", "running"))

    @property
    def final_accuracy(self) -> float | None:
        return self.summary.get("final_accuracy")

    @property
    def best_accuracy(self) -> float | None:
        return self.summary.get("best_accuracy")

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """One row per round attempt (or model version, asynchronous): metrics.jsonl."""
        return self.records("metrics")

    def records(self, name: str) -> list[dict[str, Any]]:
        """A record log of the run by name: ``metrics``, or a method's own (KDIA's ``teacher``)."""
        from fedmq.coordinator.storage.run_dir import read_jsonl

        path = self.directory / f"{name}.jsonl"
        if not name.isidentifier() or not path.exists():
            known = sorted(p.stem for p in self.directory.glob("*.jsonl") if p.stem != "events")
            raise KeyError(f"{self.directory} has no record log {name!r}; it has {', '.join(known) or 'none yet'}")
        return read_jsonl(path)

    @property
    def participation(self) -> dict[str, dict[str, Any]]:
        """Per node: rounds selected, updates accepted, late, lost, rejected, failed, intervals."""
        path = self.directory / "participation.json"
        return dict(json.loads(path.read_text())) if path.exists() else {}

    @property
    def curves(self) -> dict[str, list[tuple[int, float]]]:
        """Test accuracy by round per evaluated model: ``"global"``, and a method's others (``teacher``)."""
        from fedmq.experiments.report import read_curves

        curves = read_curves(self.directory / "metrics.jsonl")
        return {name or "global": list(points) for name, points in curves.items()}

    def plot(self, path: PathLike | None = None) -> Figure:
        """The accuracy curves as a matplotlib figure (saved to `path` if given)."""
        from matplotlib.figure import Figure

        figure = Figure(figsize=(6, 3.5), layout="constrained")
        axes = figure.add_subplot()
        for name, points in self.curves.items():
            axes.plot([r for r, _ in points], [a for _, a in points], label=name)
        axes.set(xlabel=self.config.step_name, ylabel="test accuracy", title=self.config.name)
        axes.grid(alpha=0.3)
        if len(self.curves) > 1:
            axes.legend()
        if path is not None:
            figure.savefig(path, dpi=120)
        return figure

    def replay(self, *, device: str | torch.device | None = None, check: bool = True) -> Outcome:
        """`fedmq.replay` of this run."""
        return replay(self.directory, device=device, check=check)

    def __repr__(self) -> str:
        accuracy = self.final_accuracy
        shown = f", final accuracy {accuracy:.4f}" if isinstance(accuracy, float) else ""
        return f"<fedmq run {self.config.name!r} in {self.directory}: {self.state}{shown}>"
