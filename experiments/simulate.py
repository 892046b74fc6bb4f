"""`fedmq simulate EXP.yaml`: the whole federation in one process on a virtual clock, under a scenario.

The same engine, halves, data and seeds as `fedmq run`; what the clock decides comes from the
scenario, not from this machine: when each node is online, how long its tasks take (the modelled
compute time plus the link's transfer of the model both ways), and which tasks it drops. Nothing
sleeps, so a day of availability for a thousand nodes runs in the time its training takes. The
run directory has the same files as a real run's, `events.jsonl` included, so it can be replayed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.commands import TaskSpec
from fedmq.coordinator.engine.local import ComputeTime, LocalFederation
from fedmq.coordinator.eventlog import FILENAME as EVENT_LOG
from fedmq.coordinator.eventlog import EventLog, log_header
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.reporting import Evaluator, outcome_fields, write_run_files
from fedmq.coordinator.run_dir import RunDir
from fedmq.experiments.build import node_scripts
from fedmq.experiments.config import ExperimentConfig
from fedmq.experiments.local import build_local, fault_delays
from fedmq.fednode.scenario import NodeScript


def scripted_compute(
    scripts: Mapping[str, NodeScript], samples: Mapping[str, int], model_bytes: int, base: ComputeTime
) -> ComputeTime:
    """A task's virtual duration: the model over the link, the modelled compute (at least `base`'s,
    the experiment's fault delays), the update back; None when the node drops it."""
    counts: Counter[str] = Counter()

    def compute_s(node: str, task: TaskSpec) -> float | None:
        k = counts[node]
        counts[node] += 1
        script = scripts.get(node)
        extra = base(node, task) or 0.0
        if script is None:
            return extra
        if script.drops(node, k):
            return None
        return script.transfer_s(model_bytes) + script.compute_s(samples[node]) + extra + script.transfer_s(model_bytes)

    return compute_s


def schedule(fed: LocalFederation, scripts: Mapping[str, NodeScript]) -> None:
    """Each node's availability as NodeSeen events on the virtual clock."""
    for node, script in scripts.items():
        if not script.starts_online:
            fed.at(0.0, e.NodeSeen(node, False))
        for transition in script.transitions:
            fed.at(transition.at, e.NodeSeen(node, transition.online))


def build_simulation(
    cfg: ExperimentConfig, out: Path, *, device: torch.device | None = None
) -> tuple[LocalFederation, EventLog]:
    log = EventLog(out / EVENT_LOG)
    fed = build_local(cfg, device=device, event_log=log)
    scripts = node_scripts(cfg)
    if scripts:
        samples = {node: len(n.data) for node, n in fed.nodes.items()}
        model_bytes = sum(t.numel() * t.element_size() for t in fed.half.model.state_dict().values())
        fed.compute_s = scripted_compute(scripts, samples, model_bytes, fault_delays(cfg))
        schedule(fed, scripts)
    return fed, log


def simulate(
    cfg: ExperimentConfig, out: Path, *, device: torch.device | None = None, console: Console | None = None
) -> dict[str, Any]:
    """Run `cfg` in simulation; write its run directory; the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    console = console or Console(stderr=True)
    fed, log = build_simulation(cfg, out, device=device)
    log.start(log_header(fed.engine.config))
    progress = Progress(
        TextColumn(f"{cfg.step_name}s"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    started = time.perf_counter()
    calls = 0
    run_dir = RunDir(out)
    flushed = 0

    def show() -> bool:
        nonlocal calls, flushed
        calls += 1
        if len(fed.records) > flushed:  # metrics.jsonl grows as the run goes, as a daemon's does
            for record in fed.records[flushed:]:
                run_dir.append_metrics(record)
            flushed = len(fed.records)
        if calls % 64 == 0:
            progress.update(bar, completed=fed.engine.version, status=f"virtual {fed.clock.now():,.0f} s")
        return False

    try:
        with progress:
            bar = progress.add_task("", total=cfg.steps, status="")
            fed.run(until=show)
            progress.update(bar, completed=fed.engine.version)
    finally:
        log.close()
    return write_local_run(out, cfg, fed, wall_s=time.perf_counter() - started, metrics_written=flushed)


def write_local_run(
    out: Path,
    cfg: ExperimentConfig,
    fed: LocalFederation,
    *,
    wall_s: float,
    extra: Mapping[str, Any] | None = None,
    metrics_written: int = 0,
) -> dict[str, Any]:
    """The run files of an in-process run, as the daemon writes them (the first `metrics_written`
    metrics lines are in metrics.jsonl already)."""
    run_dir = RunDir(out)
    for record in fed.records[metrics_written:]:
        run_dir.append_metrics(record)
    for name, lines in fed.round_records.items():
        run_dir.append_records(name, lines)
    evaluator = fed.evaluate if isinstance(fed.evaluate, Evaluator) else None
    simulated = fed.clock.now()
    summary = {
        **dict(extra or {}),
        "mode": "simulated",
        "method": cfg.method.name,
        "federation": cfg.federation,
        "engine": cfg.engine.kind,
        "state": fed.engine.state,
        "nodes": len(fed.nodes),
        **outcome_fields(fed.engine, evaluator, fed.half),
        "wall_seconds": round(wall_s, 3),
        "simulated_seconds": round(simulated, 3),
        "simulated_per_wall_second": round(simulated / wall_s, 1) if wall_s > 0 else None,
        "tasks_dropped": fed.dropped,
        "updates_lost_in_flight": fed.lost_in_flight,
        "vectorized": fed.vectorize,
        "groups_trained": fed.groups_trained,
        "train_seconds": round(fed.train_seconds, 3),
        "images_trained": fed.images_trained,
        "train_share": round(fed.train_seconds / wall_s, 3) if wall_s > 0 else None,
    }
    write_run_files(run_dir, summary, fed.engine.participation, NodeRegistry())
    return summary
