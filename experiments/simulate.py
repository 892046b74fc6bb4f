"""`fedmq simulate EXP.yaml`: the whole federation in one process on a virtual clock, under a scenario.

The same engine, halves, data and seeds as `fedmq run`; what the clock decides comes from the
scenario, not from this machine: when each node is online, how long its tasks take (the modelled
compute time plus the link's transfer of the model both ways), and which tasks it drops. Nothing
sleeps, so a day of availability for a thousand nodes runs in the time its training takes. The
run directory has the same files as a real run's, `events.jsonl` included, so it can be replayed.
Every ``simulation.checkpoint_every`` rounds it leaves a checkpoint, and ``--resume`` continues a
cut-off run from it to the same end as an uncut run (`experiments.sim_checkpoint`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedmq.coordinator.drivers.local import ComputeTime, LocalFederation
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.commands import Checkpoint, TaskSpec
from fedmq.coordinator.observers.reporting import Evaluator, outcome_fields, write_run_files
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG
from fedmq.coordinator.storage.eventlog import EventLog, log_header
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.experiments.build import node_scripts
from fedmq.experiments.config import ExperimentConfig
from fedmq.experiments.local import build_local, fault_delays, seeded_ids
from fedmq.experiments.sim_checkpoint import (
    CheckpointedFederation,
    CountedIds,
    ResumeError,
    load,
    restore_simulation,
    resume_refusal,
    save,
)
from fedmq.fednode.scenario import NodeScript


class ScriptedCompute:
    """A task's virtual duration: the model over the link, the modelled compute (at least `base`'s,
    the experiment's fault delays), the update back; None when the node drops it. Its per-node task
    counts (a script drops a node's k-th task) are state a checkpoint keeps (`sim_checkpoint`)."""

    def __init__(
        self, scripts: Mapping[str, NodeScript], samples: Mapping[str, int], model_bytes: int, base: ComputeTime
    ) -> None:
        self.scripts = scripts
        self.samples = samples
        self.model_bytes = model_bytes
        self.base = base
        self.counts: Counter[str] = Counter()

    def __call__(self, node: str, task: TaskSpec) -> float | None:
        k = self.counts[node]
        self.counts[node] += 1
        script = self.scripts.get(node)
        extra = self.base(node, task) or 0.0
        if script is None:
            return extra
        if script.drops(node, k):
            return None
        transfer = script.transfer_s(self.model_bytes)
        return transfer + script.compute_s(self.samples[node]) + extra + transfer


def schedule(fed: LocalFederation, scripts: Mapping[str, NodeScript]) -> None:
    """Each node's availability as NodeSeen events on the virtual clock."""
    for node, script in scripts.items():
        if not script.starts_online:
            fed.at(0.0, e.NodeSeen(node, False))
        for transition in script.transitions:
            fed.at(transition.at, e.NodeSeen(node, transition.online))


def build_simulation(
    cfg: ExperimentConfig, out: Path, *, device: torch.device | None = None
) -> tuple[CheckpointedFederation, EventLog]:
    log = EventLog(out / EVENT_LOG)
    fed = build_local(
        cfg,
        device=device,
        event_log=log,
        kind=CheckpointedFederation,
        checkpoint_every=cfg.simulation.checkpoint_every,
    )
    assert isinstance(fed, CheckpointedFederation)
    draw_task_ids(fed, log, cfg.seed)
    scripts = node_scripts(cfg)
    if scripts:
        samples = {node: len(n.data) for node, n in fed.nodes.items()}
        model_bytes = sum(t.numel() * t.element_size() for t in fed.half.model.state_dict().values())
        compute = ScriptedCompute(scripts, samples, model_bytes, fault_delays(cfg))
        fed.compute_s, fed.task_counts = compute, compute.counts
        schedule(fed, scripts)
    return fed, log


def draw_task_ids(fed: CheckpointedFederation, log: EventLog, seed: int, skip: int = 0) -> None:
    """The engine's task ids: the run's id stream (`seeded_ids`) past its first `skip` ids, counted
    (a checkpoint says how many were drawn) and recorded in the event log."""
    fed.ids = CountedIds(seeded_ids(seed, skip=skip), drawn=skip)
    fed.engine.new_id = log.recording(fed.ids)


class MetricsWriter:
    """metrics.jsonl grows as the run goes, as a daemon's does; a checkpoint writes every line and
    record before it (a resumed run must find the rounds it does not run again)."""

    def __init__(self, out: Path, fed: LocalFederation) -> None:
        self.run_dir = RunDir(out)
        self.fed = fed
        self.written = 0

    def metrics(self) -> None:
        for record in self.fed.records[self.written :]:
            self.run_dir.append_metrics(record)
        self.written = len(self.fed.records)

    def everything(self) -> None:
        """The metrics and the algorithm's round records (KDIA's teacher weights) so far."""
        self.metrics()
        for name, lines in self.fed.round_records.items():
            self.run_dir.append_records(name, lines)
        self.fed.round_records.clear()


def simulate(
    cfg: ExperimentConfig,
    out: Path,
    *,
    device: torch.device | None = None,
    console: Console | None = None,
    resume: bool = False,
) -> dict[str, Any]:
    """Run `cfg` in simulation; write its run directory; the summary. With `resume`, continue the run
    in `out` from its checkpoint (from the start when it has none; a finished run is not run again)."""
    if resume:
        finished = prepare_resume(cfg, out)
        if finished is not None:
            return finished
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(cfg.to_yaml())
    console = console or Console(stderr=True)
    fed, log = build_simulation(cfg, out, device=device)
    writer = MetricsWriter(out, fed)

    def checkpoint(command: Checkpoint, moment: Mapping[str, Any]) -> None:
        started = time.perf_counter()
        writer.everything()
        save(writer.run_dir, fed, command, moment)
        fed.coordinator_seconds["checkpoints"] += time.perf_counter() - started

    fed.on_checkpoint = checkpoint
    resumed = resume_from_checkpoint(cfg, fed, log, writer.run_dir) if resume else None
    log.start(log_header(fed.engine.config), resumed=resumed)
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

    def show() -> bool:
        nonlocal calls
        calls += 1
        if len(fed.records) > writer.written:
            writer.metrics()
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
    extra = {"resumed_from_round": resumed["round"]} if resumed else None
    return write_local_run(
        out, cfg, fed, wall_s=time.perf_counter() - started, extra=extra, metrics_written=writer.written
    )


def wall_by_part(fed: LocalFederation, wall_s: float) -> dict[str, float]:
    """The run's wall seconds split by what this process spent them on: the nodes' training, the
    coordinator's aggregation (with KDIA's teacher and generator), evaluation and checkpoints, and the
    rest (the engine, the event log and metrics, the progress bar). Where a cell's time went, for the
    one to make faster; work a GPU queued in one part and finished in the next is counted in the next."""
    parts = {"training": fed.train_seconds}
    parts |= {name: fed.coordinator_seconds[name] for name in ("aggregation", "evaluation", "checkpoints")}
    parts["other"] = max(wall_s - sum(parts.values()), 0.0)
    return {name: round(seconds, 3) for name, seconds in parts.items()}


def prepare_resume(cfg: ExperimentConfig, out: Path) -> dict[str, Any] | None:
    """Check that `out`'s run can be resumed as `cfg`; its summary when it finished already."""
    refusal = resume_refusal(cfg)
    if refusal is not None:
        raise ResumeError(f"--resume: {refusal}")
    if made_by_another(out, cfg):
        raise ResumeError(
            f"--resume: the run in {out} was made with another experiment (its config.yaml differs);"
            " use another --out, or run it again without --resume"
        )
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(summary, dict) and summary.get("state") == "finished":
        return dict(summary)
    return None


def made_by_another(out: Path, cfg: ExperimentConfig) -> bool:
    """Whether `out` holds a run of another experiment than `cfg` (how often it checkpoints and its
    federation id aside: neither changes the outcome)."""
    try:
        made = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return not isinstance(made, dict) or _comparable(made) != _comparable(yaml.safe_load(cfg.to_yaml()))


def _comparable(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in ("simulation", "federation")}


def resume_from_checkpoint(
    cfg: ExperimentConfig, fed: CheckpointedFederation, log: EventLog, run_dir: RunDir
) -> dict[str, Any] | None:
    """Put `fed` where `run_dir`'s checkpoint left the run; what the event log says of it. Without a
    checkpoint the run starts afresh, and what an attempt wrote before its first checkpoint goes."""
    meta = load(run_dir, fed)
    if meta is None:
        run_dir.truncate_metrics_after(-1)
        return None
    loaded = run_dir.load_checkpoint()
    assert loaded is not None
    restore_simulation(fed, meta, loaded[0])
    draw_task_ids(fed, log, cfg.seed, skip=int(meta["simulation"]["task_ids"]))
    fed.note_checkpoint(int(meta["round"]))
    run_dir.truncate_metrics_after(int(meta["round"]))
    return {"round": int(meta["round"]), "version": fed.engine.version, "clock": fed.clock.now()}


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
        **outcome_fields(fed.engine, evaluator, fed.half, fed.node_privacy),
        "wall_seconds": round(wall_s, 3),
        "simulated_seconds": round(simulated, 3),
        "simulated_per_wall_second": round(simulated / wall_s, 1) if wall_s > 0 else None,
        "tasks_dropped": fed.dropped,
        "updates_lost_in_flight": fed.lost_in_flight,
        "vectorized": fed.vectorize,
        "groups_trained": fed.groups_trained,
        # with simulation.reuse_rounds: the groups that trained in a kept round, built one, or kept none
        "rounds_kept": {k: fed.rounds_kept[k] for k in ("reused", "built", "not kept")} if fed.reuse_rounds else None,
        "train_seconds": round(fed.train_seconds, 3),
        "images_trained": fed.images_trained,
        "train_share": round(fed.train_seconds / wall_s, 3) if wall_s > 0 else None,
        "wall_seconds_by_part": wall_by_part(fed, wall_s),
    }
    write_run_files(run_dir, summary, fed.engine.participation, NodeRegistry())
    return summary
