"""`fedmq replay RUN_DIR`: a recorded run replayed in this process and checked step by step, or
re-run counterfactually (`--set`) on the availability and timing it really had.

Exact replay (`coordinator.drivers.replay.Replay`) feeds the engine the log's events and recomputes
everything else; it must reproduce every update, every aggregated model and every evaluation, and
the summary's final model hash. A counterfactual replay changes the experiment (another method,
seed, buffer size, ...), so its updates and decisions differ from the record's; what it keeps is the
trace: when each node was online, and how long each of its tasks took (its k-th task in the
counterfactual takes as long as its k-th recorded one; a task that never came back is lost again).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from fedmq.coordinator.drivers.replay import Entry, Replay, ReplayError, ReplayMismatch, ReplayReport, read_log
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.commands import TaskSpec
from fedmq.coordinator.observers.reporting import reproducible
from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG
from fedmq.coordinator.storage.eventlog import EventLog, log_header
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.experiments.config import ExperimentConfig, apply_overrides, parse_config
from fedmq.experiments.local import build_local
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.training import torch_threads

__all__ = ["ReplayError", "ReplayMismatch", "Trace", "counterfactual", "load_run", "replay_run", "trace_of"]


@dataclass(frozen=True)
class Run:
    """A run directory's config (as the run used it), event log and summary."""

    root: Path
    config: dict[str, Any]
    header: Mapping[str, Any]
    entries: list[Entry]
    summary: Mapping[str, Any]


def load_run(root: Path) -> Run:
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"{root} is not a run directory")
    try:
        config = yaml.safe_load((root / "config.yaml").read_text())
    except OSError as exc:
        raise ConfigError(f"{root}: cannot read config.yaml ({exc.strerror}); is this a run directory?") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{root}/config.yaml is not an experiment")
    header, entries = read_log(root / EVENT_LOG)
    try:
        summary = json.loads((root / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = {}  # a run that died before its summary still replays as far as its log goes
    return Run(root, config, header, entries, summary)


def _config(run: Run, overrides: Sequence[str] = ()) -> ExperimentConfig:
    data = apply_overrides(dict(run.config), list(overrides)) if overrides else dict(run.config)
    data["federation"] = run.header.get("federation", data.get("federation"))
    return parse_config(data, source=f"{run.root}/config.yaml")


@dataclass
class Outcome:
    report: ReplayReport
    wall_seconds: float
    original_wall_seconds: float | None
    records: list[dict[str, Any]]
    mismatch: ReplayMismatch | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatch is None and self.report.complete and not self.notes


def replay_run(root: Path, *, device: torch.device | None = None, threads: int = 1) -> Outcome:
    """Replay `root` exactly; the outcome says whether every step matched and where it first did not."""
    run = load_run(root)
    cfg = _config(run)
    started = time.perf_counter()
    with torch_threads(threads):  # as the daemons train (hosting.threads_per_process): sums in one order
        fed = build_local(
            cfg,
            device=device or torch.device("cpu"),
            eval_device=str(device or "cpu"),
            kind=Replay,
            entries=run.entries,
        )
        assert isinstance(fed, Replay)
        mismatch = None
        try:
            fed.replay()
        except ReplayMismatch as exc:
            mismatch = exc
    outcome = Outcome(fed.report, time.perf_counter() - started, run.summary.get("wall_seconds"), fed.records, mismatch)
    if mismatch is None:
        outcome.notes.extend(_final_checks(run, fed))
    why = unreplayable(cfg, device or torch.device("cpu"))
    if why and (mismatch is not None or outcome.notes):
        outcome.notes.append(why)
    return outcome


def unreplayable(cfg: ExperimentConfig, device: torch.device) -> str | None:
    """Why a replay on `device` may differ from its run whatever fedmq does, or None: a GPU run whose
    cuDNN was free to sum with atomics (`simulation.cudnn`)."""
    if device.type != "cuda" or cfg.simulation.cudnn == "deterministic":
        return None
    return (
        f"the run was simulated with simulation.cudnn: {cfg.simulation.cudnn}, whose GPU convolutions may sum in"
        " another order on every run: its replay on a GPU can differ in the last bits; only runs with"
        " simulation.cudnn: deterministic (the default) replay bit for bit there"
    )


def _final_checks(run: Run, fed: Replay) -> list[str]:
    """What the log's last lines cannot say: the run's end, its final model, its metrics lines."""
    notes = []
    if not fed.report.complete:
        last = run.entries[-1].line if run.entries else 1
        notes.append(f"the log ends at line {last} before the run finished (truncated, or the run was killed)")
    recorded = run.summary.get("model_sha256")
    if fed.report.complete and recorded and recorded != fed.report.final_model_sha256:
        notes.append(f"final model: sha256 {recorded} in summary.json, {fed.report.final_model_sha256} replayed")
    metrics = run.root / "metrics.jsonl"
    if metrics.exists():
        theirs = [reproducible(json.loads(line), fed.half) for line in metrics.read_text().splitlines() if line.strip()]
        ours = [reproducible(json.loads(json.dumps(r, sort_keys=True)), fed.half) for r in fed.records]
        for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
            if a != b:
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
                notes.append(f"metrics.jsonl line {i + 1} differs in {', '.join(keys)}")
                break
        else:
            if fed.report.complete and len(ours) != len(theirs):
                notes.append(f"metrics.jsonl has {len(theirs)} lines, the replay {len(ours)}")
    return notes


def write_replay(out: Path, outcome: Outcome) -> None:
    """The replay's metrics lines and a summary of what it checked, in `out`."""
    run_dir = RunDir(out)
    for record in outcome.records:
        run_dir.append_metrics(record)
    r = outcome.report
    run_dir.write_json(
        "replay.json",
        {
            "ok": outcome.ok,
            "mismatch": str(outcome.mismatch) if outcome.mismatch is not None else None,
            "notes": outcome.notes,
            "events": r.events,
            "updates_matched": r.updates,
            "aggregations_matched": r.aggregations,
            "evaluations_matched": r.evaluations,
            "commands_matched": r.commands,
            "complete": r.complete,
            "final_model_sha256": r.final_model_sha256,
            "wall_seconds": round(outcome.wall_seconds, 3),
            "original_wall_seconds": outcome.original_wall_seconds,
        },
    )


# -- counterfactual replay ---------------------------------------------------------------------------


@dataclass
class Trace:
    """What a recorded run says of its nodes' availability and timing, in seconds from its start."""

    availability: list[tuple[float, str, bool]]
    durations: dict[str, list[float | None]]
    """Per node, each task's time from sending to the update's arrival, in order; None: it never came."""
    horizon_s: float

    def compute(self) -> Callable[[str, TaskSpec], float | None]:
        """The counterfactual's compute times: a node's k-th task takes what its k-th recorded one took
        (its recorded tasks again in turn once they run out; the median of all for a node that had none)."""
        known = [d for ds in self.durations.values() for d in ds if d is not None]
        fallback = statistics.median(known) if known else 0.0
        counts: dict[str, int] = defaultdict(int)

        def compute_s(node: str, task: TaskSpec) -> float | None:
            recorded = self.durations.get(node)
            k = counts[node]
            counts[node] += 1
            if not recorded:
                return fallback
            return recorded[k % len(recorded)]

        return compute_s


def trace_of(entries: Sequence[Entry]) -> Trace:
    """The availability and per-task durations a log records."""
    if not entries:
        raise ReplayError("the event log holds no events")
    t0 = next((float(x.data["t"]) for x in entries if "t" in x.data), 0.0)
    availability: list[tuple[float, str, bool]] = []
    tasks: dict[int, dict[str, str]] = {}
    in_flight: dict[tuple[str, str], tuple[int, float]] = {}
    """(task hex, node): the task's index among the node's, and when it was sent."""
    durations: dict[str, list[float | None]] = defaultdict(list)
    now = t0
    for x in entries:
        d = x.data
        try:
            now = float(d.get("t", now))
            if d.get("ev") == "NodeSeen":
                availability.append((now - t0, str(d["node"]), bool(d["online"])))
            elif d.get("cmd") == "Configure":
                tasks[int(d["step"])] = {str(node): str(task) for node, task, *_ in d["tasks"]}
            elif d.get("cmd") == "SendTask":
                node = str(d["node"])
                in_flight[(tasks[int(d["step"])][node], node)] = (len(durations[node]), now)
                durations[node].append(None)
            elif d.get("ev") == "UpdateArrived" and "failed" not in d["meta"]:
                task = d["meta"].get("task")
                sent = in_flight.pop((str(task.get("$b")), str(d["node"])), None) if isinstance(task, dict) else None
                if sent is not None:
                    durations[str(d["node"])][sent[0]] = now - sent[1]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ReplayError(f"line {x.line}: cannot read the trace from it: {exc!r}") from None
    return Trace(availability, dict(durations), now - t0)


def counterfactual(
    root: Path, overrides: Sequence[str], out: Path, *, device: torch.device | None = None, threads: int = 1
) -> dict[str, Any]:
    """The run's trace replayed with `overrides` applied; its run files in `out`; a comparison."""
    run = load_run(root)
    cfg = _config(run, overrides)
    trace = trace_of(run.entries)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    log = EventLog(out / EVENT_LOG)
    started = time.perf_counter()
    with torch_threads(threads):
        fed = build_local(
            cfg, device=device or torch.device("cpu"), eval_device=str(device or "cpu"), compute_s=trace.compute(),
            event_log=log,
        )  # fmt: skip
        for when, node, online in trace.availability:
            if node in fed.nodes:
                fed.at(when, e.NodeSeen(node, online))
        log.start(log_header(fed.engine.config))
        try:
            fed.run()
        finally:
            log.close()
    from fedmq.experiments.simulate import write_local_run

    summary = write_local_run(
        out, cfg, fed, wall_s=time.perf_counter() - started, extra={"counterfactual_of": str(root)}
    )
    return {
        "original": {k: run.summary.get(k) for k in ("method", "final_accuracy", "best_accuracy", "model_sha256")},
        "counterfactual": {k: summary.get(k) for k in ("method", "final_accuracy", "best_accuracy", "model_sha256")},
        "changed": list(overrides),
        "out": str(out),
    }
