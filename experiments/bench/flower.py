"""`fedmq bench flower`: fedmq over mosquitto against Flower's simulation and deployment runtimes.

The same workload on both sides (`flower_workload`: fedmq's data, Dirichlet partition, model, local
SGD with each node's seeded generator, FedAvg's weighted mean in node order), so Flower's accuracy
after each round should equal fedmq's: the check that the comparison is fair, reported beside the
times. Measured, each from its launch to the evaluation of the final global model:

- fedmq: `fedmq run` of the workload (coordinator and two node-host processes) over mosquitto;
  round ends are taken from the coordinator's status topic as they are pushed.
- Flower simulation: `flwr run` against ``flower-superlink --simulation`` (Ray; by default a client
  takes both cores, so clients train one at a time).
- Flower deployment runtime: `flwr run` against ``flower-superlink`` and one ``flower-supernode`` per
  node on loopback, already started and registered (their start-up is reported, not counted).

Round overhead: the ``noop`` method (nodes return the model they received) on a tiny model, seconds
per round (median) in fedmq and in Flower's deployment runtime, whose SuperNodes sleep 3 s when they
find no message and whose ServerApp polls for replies every 3 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fedmq.broker import BusClient, BusConfig, Kind, Topics
from fedmq.experiments.bench.brokers import broker_kind, running_broker
from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.flower_runtime import Runtime, flower_env
from fedmq.experiments.bench.flower_workload import WorkloadSpec, experiment, mnist_available, shared_data_root
from fedmq.experiments.build import preflight
from fedmq.experiments.config import ExperimentConfig
from fedmq.fedcore.errors import ConfigError

TITLE = "end to end against Flower (simulation and deployment runtime): same FedAvg, wall time, accuracy"

OVERHEAD_TARGET = 10.0
"""Flower deployment's seconds per round over fedmq's, at least."""
TIME_TO_ACCURACY_TARGET = 2.0
"""Flower simulation's wall time to the same accuracy over fedmq's, at least."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The suite's settings; ``--opt key=value`` overrides any of them."""

    dataset: str
    nodes: int
    rounds: int
    epochs: int
    overhead_rounds: int
    sim_overhead: bool
    """Also time the round overhead in Flower's simulation (Ray start-up is paid again)."""
    flower_threads: int
    """torch threads in each Flower app process (0: torch's default). 1, as in fedmq's node processes:
    the same arithmetic bit for bit, and on a busy 2-core machine 2 threads run about 7x slower than 1."""
    flower_venv: Path
    timeout_s: float
    """Per federation run."""

    @classmethod
    def from_options(cls, options: BenchOptions) -> Settings:
        root = shared_data_root()
        full = cls(
            dataset="mnist" if mnist_available(root) else "digits",
            nodes=10,
            rounds=3,
            epochs=1,
            overhead_rounds=3,
            sim_overhead=False,
            flower_threads=1,
            flower_venv=options.work_dir / "flower-venv",
            timeout_s=900.0,
        )
        quick = replace(full, dataset="digits", nodes=2, rounds=2, overhead_rounds=2, sim_overhead=False, timeout_s=300)
        base = quick if options.quick else full
        parsers: dict[str, Callable[[str], Any]] = {
            "dataset": str,
            "nodes": int,
            "rounds": int,
            "epochs": int,
            "overhead_rounds": int,
            "sim_overhead": _flag,
            "flower_threads": int,
            "flower_venv": Path,
            "timeout_s": float,
        }
        unknown = sorted(set(options.extra) - set(parsers))
        if unknown:
            raise ConfigError(f"--opt {', '.join(unknown)}: the flower suite knows {', '.join(parsers)}")
        try:
            changes = {k: parsers[k](v) for k, v in options.extra.items()}
        except ValueError as exc:
            raise ConfigError(f"--opt for the flower suite: {exc}") from None
        return replace(base, **changes)

    def train_spec(self) -> WorkloadSpec:
        root = shared_data_root()
        return WorkloadSpec(
            dataset=self.dataset,
            data_root=str(root) if root and self.dataset not in ("digits", "synthetic") else None,
            nodes=self.nodes,
            rounds=self.rounds,
            local_epochs=self.epochs,
        )

    def noop_spec(self) -> WorkloadSpec:
        return WorkloadSpec(dataset="digits", nodes=self.nodes, rounds=self.overhead_rounds, hidden=(8,), method="noop")


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a yes/no value")


@dataclass(frozen=True, slots=True)
class Measured:
    """One framework's run of one workload: wall-clock times from its launch, and accuracy per round."""

    name: str
    wall_s: float
    """Launch to the evaluation of the final global model."""
    round_s: list[float]
    accuracies: list[float]
    to_round_s: list[float] = field(default_factory=list)
    """Launch to the end of each round."""

    @property
    def startup_s(self) -> float:
        """Launch to the start of the first round: processes, imports, data, connections."""
        return self.to_round_s[0] - self.round_s[0]

    @property
    def per_round_s(self) -> float:
        return statistics.median(self.round_s)

    @property
    def final_accuracy(self) -> float:
        return self.accuracies[-1]

    def seconds_to(self, accuracy: float) -> float | None:
        return next((t for t, a in zip(self.to_round_s, self.accuracies, strict=True) if a >= accuracy), None)


# -- fedmq ---------------------------------------------------------------------------------------


def measure_fedmq(cfg: ExperimentConfig, out: Path, url: str, *, timeout_s: float) -> Measured:
    """`fedmq run` over the broker at `url`; round ends as the coordinator pushes them on its status topic."""
    cfg = cfg.model_copy(update={"federation": f"{cfg.name}-{os.urandom(3).hex()}"})
    shutil.rmtree(out, ignore_errors=True)
    return asyncio.run(_fedmq(cfg, out, url, timeout_s))


async def _fedmq(cfg: ExperimentConfig, out: Path, url: str, timeout_s: float) -> Measured:
    from fedmq.experiments.runner import run_federation

    assert cfg.federation is not None
    ends: dict[int, float] = {}
    ready = asyncio.Event()
    watcher = asyncio.create_task(_watch_rounds(cfg.federation, url, ends, ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        launched = time.time()
        with contextlib.redirect_stdout(sys.stderr):  # its closing lines are progress, not the report
            code = await run_federation(cfg, out, broker=url, processes=2, quiet=True, timeout_s=timeout_s)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if code != 0:
        raise RuntimeError(f"fedmq run of {cfg.name} failed (exit code {code}): see {out / 'logs'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("aggregated")]
    missing = [r["round"] for r in records if r["round"] not in ends]
    if missing:
        raise RuntimeError(f"no status message for rounds {missing} of {cfg.name}; see {out / 'logs'}")
    to_round = [ends[r["round"]] - launched for r in records]
    return Measured(
        name="fedmq",
        wall_s=to_round[-1],
        round_s=[float(r["round_seconds"]) for r in records],
        accuracies=[float(r["accuracy"]) for r in records],
        to_round_s=to_round,
    )


async def _watch_rounds(federation: str, url: str, ends: dict[int, float], ready: asyncio.Event) -> None:
    """When each round ended (wall clock), from the coordinator's pushed status messages."""
    topics = Topics(federation)
    client = BusClient(
        BusConfig.from_url(url, persistent_session=False),
        client_id=f"{federation}-bench-{os.getpid()}",
        federation=federation,
    )
    async with client as bus:
        await bus.subscribe(topics.coordinator_status)
        ready.set()
        async for envelope in bus.messages():
            meta = envelope.message.meta
            if envelope.message.kind == Kind.COORDINATOR_STATUS and "round_done" in meta:
                ends.setdefault(int(meta["round_done"]), time.time())


# -- Flower --------------------------------------------------------------------------------------


def measure_flower(rt: Runtime, workload: Path, method: str, name: str, *, timeout_s: float, threads: int) -> Measured:
    run = rt.run(workload, method, name, timeout_s=timeout_s, torch_threads=threads)
    return Measured(
        name=name,
        wall_s=run.wall_s,
        round_s=run.round_seconds(),
        accuracies=[float(r["accuracy"]) for r in run.rounds],
        to_round_s=[r["time"] - run.launched for r in run.rounds],
    )


# -- the suite -----------------------------------------------------------------------------------


def run(options: BenchOptions) -> Report:
    def log(text: str) -> None:
        print(f"  {text}", file=sys.stderr, flush=True)

    settings = Settings.from_options(options)
    broker = broker_kind(options)
    work = (options.work_dir / "flower").resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = flower_env(settings.flower_venv.resolve(), log)

    train_cfg = experiment(settings.train_spec(), "bench-flower")
    noop_cfg = experiment(settings.noop_spec(), "bench-flower-noop")
    train_yaml, noop_yaml = work / "workload.yaml", work / "workload-noop.yaml"
    train_yaml.write_text(train_cfg.to_yaml())
    noop_yaml.write_text(noop_cfg.to_yaml())
    for cfg in (train_cfg, noop_cfg):
        preflight(cfg)  # decodes the dataset into the cache once, before anything is timed

    timeout, threads = settings.timeout_s, settings.flower_threads
    log(f"fedmq over {broker}: FedAvg, then noop ...")
    with running_broker(options) as url:
        fedmq_train = measure_fedmq(train_cfg, work / "fedmq-train", url, timeout_s=timeout)
        fedmq_noop = measure_fedmq(noop_cfg, work / "fedmq-noop", url, timeout_s=timeout)
    log("Flower simulation ...")
    with Runtime(env, work / "simulation", simulation=True, nodes=settings.nodes, log=log) as rt:
        sim_train = measure_flower(rt, train_yaml, "fedavg", "sim-train", timeout_s=timeout, threads=threads)
        sim_noop = (
            measure_flower(rt, noop_yaml, "noop", "sim-noop", timeout_s=timeout, threads=threads)
            if settings.sim_overhead
            else None
        )
    log(f"Flower deployment runtime ({settings.nodes} SuperNodes) ...")
    with Runtime(env, work / "deployment", simulation=False, nodes=settings.nodes, log=log) as rt:
        deploy_start_s = rt.startup_s
        dep_train = measure_flower(rt, train_yaml, "fedavg", "deploy-train", timeout_s=timeout, threads=threads)
        dep_noop = measure_flower(rt, noop_yaml, "noop", "deploy-noop", timeout_s=timeout, threads=threads)

    report = Report("flower", TITLE)
    spec = settings.train_spec()
    report.context = {
        "workload": (
            f"{spec.dataset}, {spec.nodes} nodes, Dirichlet({spec.alpha}), C = 1, {spec.rounds} rounds,"
            f" {spec.local_epochs} local epoch(s), FedAvg, mlp {list(spec.hidden)}"
        ),
        "overhead workload": f"noop, digits, mlp [8], {settings.nodes} nodes, {settings.overhead_rounds} rounds",
        "flwr": env.version,
        "fedmq broker": broker,
        "fedmq node processes": 2,
    }
    _training_figures(report, broker, fedmq_train, sim_train, dep_train)
    _overhead_figures(report, broker, fedmq_noop, dep_noop, sim_noop)
    _targets(report, fedmq_train, sim_train, fedmq_noop, dep_noop)
    report.notes += [
        "Wall times run from each launch (`fedmq run`; `flwr run`) to the evaluation of the final global model;"
        " fedmq's include starting its coordinator and node processes, Flower deployment's exclude starting"
        f" the SuperLink and SuperNodes ({deploy_start_s:.1f} s here), as they are long-lived daemons.",
        "Flower simulation: Ray backend with its default client resources (2 CPUs a client: one client at a"
        " time here); deployment: default isolation (a ClientApp process per message); torch threads per"
        f" Flower app process: {threads or 'torch default'} (fedmq's node processes: 1).",
        "Flower's noop ClientApp returns the model without importing torch: its overhead is Flower's own.",
    ]
    return report


def _training_figures(report: Report, broker: str, fedmq: Measured, sim: Measured, dep: Measured) -> None:
    section = "FedAvg workload"
    flowers = (("Flower simulation", sim), ("Flower deployment", dep))
    rows = (
        ("wall time", lambda m: m.wall_s),
        ("launch to first round", lambda m: m.startup_s),
        ("seconds per round (median)", lambda m: m.per_round_s),
    )
    for what, value in rows:
        ours = value(fedmq)
        report.add(f"fedmq over {broker}: {what}", ours, "s", section=section)
        for name, m in flowers:
            report.add(f"{name}: {what}", value(m), "s", ratio=value(m) / ours, ratio_means="fedmq's", section=section)
    report.add(f"fedmq over {broker}: final accuracy", fedmq.final_accuracy, "", section=section)
    for name, m in flowers:
        gap = max(abs(a - b) for a, b in zip(m.accuracies, fedmq.accuracies, strict=True))
        note = f"largest gap to fedmq over the rounds {gap:.4f}"
        report.add(f"{name}: final accuracy", m.final_accuracy, "", note=note, section=section)


def _overhead_figures(report: Report, broker: str, fedmq: Measured, dep: Measured, sim: Measured | None) -> None:
    section = "Round overhead: seconds per round, noop on a tiny model (median)"
    report.add(f"fedmq over {broker}: round overhead", fedmq.per_round_s, "s", section=section)
    others = [("Flower deployment: round overhead", dep)]
    if sim is not None:
        others.append(("Flower simulation: round overhead", sim))
    for label, m in others:
        ratio = m.per_round_s / fedmq.per_round_s
        report.add(label, m.per_round_s, "s", ratio=ratio, ratio_means="fedmq's", section=section)


def _targets(report: Report, fedmq: Measured, sim: Measured, fedmq_noop: Measured, dep_noop: Measured) -> None:
    theirs_s, ours_s = dep_noop.per_round_s, fedmq_noop.per_round_s
    report.target(
        f"Round overhead at least {OVERHEAD_TARGET:g}x below Flower's deployment runtime's",
        f"Flower deployment / fedmq: {theirs_s / ours_s:,.0f}x ({theirs_s:.3f} s vs {ours_s:.4f} s a round)",
        theirs_s / ours_s >= OVERHEAD_TARGET,
    )
    accuracy = min(fedmq.final_accuracy, sim.final_accuracy)
    ours, theirs = fedmq.seconds_to(accuracy), sim.seconds_to(accuracy)
    text = f"Wall time to the same accuracy at least {TIME_TO_ACCURACY_TARGET:g}x better than Flower's simulation"
    if ours is None or theirs is None:
        report.target(text, f"accuracy {accuracy:.4f} not reached by both", False)
        return
    ratio = theirs / ours
    report.target(
        text,
        f"Flower simulation / fedmq: {ratio:.2f}x to accuracy {accuracy:.4f} ({theirs:.1f} s vs {ours:.1f} s)",
        ratio >= TIME_TO_ACCURACY_TARGET,
    )
