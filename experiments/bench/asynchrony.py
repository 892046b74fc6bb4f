"""Asynchronous aggregation: FedAsync and FedBuff against synchronous FedAvg when node speeds differ.

**Workload.** The quickstart's federation: the 8x8 digits, Dirichlet label skew 0.3, the small CNN,
2 local epochs of SGD (batch 16, lr 0.05, momentum 0.9), 30 nodes, seed 0.

**Speeds.** Node k computes for ``median_s x exp(sigma x z_k)`` seconds a task (lognormal,
median 1 s, sigma 0.5), and a seeded tenth of the nodes is 10x slower than its draw; the same
seed gives the same speeds to every run (here 0.40 to 1.47 s for 27 nodes, 4.8, 6.8 and 10.5 s
for the slow three). On the bus each node daemon sleeps its time after training (the
experiment's ``faults: {node: {delay_s}}``), so a task takes that plus training and transfers.
In virtual time (`experiments.local.build_local`, the engine's in-process driver, the same
experiment) the delays are the compute times and nothing else costs time: training, aggregation
and evaluation are instantaneous, and the run is deterministic, free of this machine's noise.

**Synchronous FedAvg**, the baseline: C = 0.25, so 7 updates close a round, and 10 nodes are
sampled (``policy.over_selection: 1.3``, the 30% over-selection of production synchronous FL,
Bonawitz et al. 2019): a slow node in a round costs only its own work. The deadline (30 s,
past the slowest node) never closes a round. The over-selected nodes' work is wasted (their
updates come after the close and are refused as late). 30 rounds, evaluated every round. Plain
FedAvg without over-selection, which waits for every sampled node and so for the slow ones in
most rounds, runs in virtual time only (on the bus it would take three minutes).

**FedAsync** (Xie et al. 2019): K = 1, each update mixed in with weight alpha x s(tau),
alpha = 0.6 and s(tau) = (1 + tau)^-0.5 (the paper's polynomial, a = 0.5), max_staleness 100.
**FedBuff** (Nguyen et al. 2022): K = 5, the buffer's mean staleness-weighted delta applied with
server_lr 1 and s(tau) = 1/sqrt(1 + tau) (the paper's), max_staleness 20 versions: both refuse an
update more than about 100 updates old. Both keep 20 nodes training: FedBuff wants concurrency
well above K (the paper: 1000 and 10), and each slow node holds its slot 10x as long, so a low
concurrency is eaten by the slow nodes, while one close to the federation leaves only the fast
nodes idle to be drawn. Tuned in virtual time on these speeds (time to the sync target, as ratios):
concurrency 10, 15, 20, 25 gave 1.05, 1.16, 1.73, 1.71x (FedAsync) and 1.05, 1.03, 1.42, 1.73x
(FedBuff); FedBuff K = 10 at 20: 1.67x; FedAsync alpha 0.9: 1.58x; max_staleness 20 for
FedAsync (20 updates): 1.58x, 152 updates refused as stale. One seed: the digits curves move by
0.1 between evaluations, so these differences are mostly noise. FedAsync makes 20 versions per
sync round (600), FedBuff 4 (120; 600 updates): about the synchronous run's length here.
Evaluated every 10 (FedAsync) and 2 (FedBuff) versions, about once a second, as the synchronous
run is (a round takes about 1.2 s).

**Time to accuracy.** The synchronous run's final accuracy is the target. A run's time to it is
the ``ended_s`` of its first evaluated metrics line at or above it, less the run's
``startup_seconds`` (the wait for the nodes to come online): seconds since the first task. The
ratio is the synchronous run's time to it (its first line at or above its own final accuracy) over
the asynchronous run's. A run that never reaches it says so, with the best it reached and when.
**Wasted updates**: tasks sent whose work reached no model: late (over-selected), lost, refused
(stale, rejected), failed, and those in flight or buffered when the run ended.

**Ingest.** The `noop` method (nodes send the model straight back) on the 442-parameter MLP of
`rounds.py`, 100 nodes, concurrency 100, K = 10 (3,000 updates; with every receipt, the default,
and with receipts for refusals only, `policy.receipts`, a third fewer messages) and K = 1 (1,000): updates
folded per second are those folded after the first tenth of the versions (the warm-up) over the
span of their ``ended_s``. Beside it, synchronous noop rounds of the same 100 nodes at C = 1: the
updates a round takes in over the median time per round. The coordinator's CPU (from /proc) over
the same span says whether it is the bottleneck.

**KDIA** against itself on the same speed law: synchronous as FedAvg above, and FedBuff (K = 5,
3 versions per sync round), 20 nodes, 20 rounds, concurrency 13, the generator shortened as in
``experiments/papers/kdia-reduced.yaml`` (1 epoch of 20 batches a version), lambda_gen 0.01;
on the bus and in virtual time (where the generator's training costs no time).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedmq.experiments.bench.brokers import broker_kind, raise_fd_limit, running_broker
from fedmq.experiments.bench.common import BenchOptions, Report, machine
from fedmq.experiments.bench.procs import descendants, role
from fedmq.experiments.bench.rounds import round_times
from fedmq.experiments.bench.rounds import workload as noop_workload
from fedmq.experiments.config import ExperimentConfig, parse_config

TITLE = "asynchronous aggregation (FedAsync, FedBuff) against synchronous FedAvg under heterogeneous speeds"

SECTIONS = ("real", "virtual", "ingest", "kdia")


@dataclass(frozen=True, slots=True)
class Settings:
    """The suite's settings; each can be set with ``--opt key=value`` (sections: a comma list)."""

    nodes: int = 30
    median_s: float = 1.0
    """Median compute time of a node's task (lognormal)."""
    sigma: float = 0.5
    """Lognormal sigma of the compute times."""
    slow_share: float = 0.1
    slow_factor: float = 10.0
    rounds: int = 30
    """Synchronous rounds; the asynchronous runs' versions scale with it."""
    concurrency: int = 20
    deadline_s: float = 30.0
    ingest_nodes: int = 100
    ingest_updates: int = 3000
    """Updates folded by the K = 10 ingest run (K = 1, one version each, folds a third as many)."""
    kdia_nodes: int = 20
    kdia_rounds: int = 20
    kdia_concurrency: int = 13
    kdia_gen_batches: int = 20
    """KDIA's generator batches per version (one epoch)."""
    kdia_on_bus: bool = True
    plain_on_bus: bool = False
    """Also run plain synchronous FedAvg (no over-selection) on the bus: about 2.5 minutes more."""
    processes: int = 2
    """Node-host processes of a federation on the bus (as `fedmq run` on two cores)."""
    sections: tuple[str, ...] = SECTIONS
    seed: int = 0


QUICK = Settings(
    nodes=8, median_s=0.05, rounds=3, concurrency=4, deadline_s=10.0, ingest_nodes=6, ingest_updates=60,
    kdia_nodes=6, kdia_rounds=2, kdia_concurrency=3, kdia_gen_batches=2, kdia_on_bus=False, processes=1,
)  # fmt: skip
"""--quick: tiny sizes (seconds a federation) and KDIA in virtual time only: checks that it all runs."""


def settings(options: BenchOptions) -> Settings:
    base = QUICK if options.quick else Settings()
    changes: dict[str, Any] = {}
    for key, value in options.extra.items():
        if key == "sections":
            names = tuple(s for s in str(value).split(",") if s)
            unknown = sorted(set(names) - set(SECTIONS))
            if unknown:
                raise ValueError(f"--opt sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")
            changes[key] = names
        elif key in Settings.__dataclass_fields__:
            kind = type(getattr(base, key))
            if kind is bool:
                changes[key] = str(value).lower() in ("1", "true", "yes")
            else:
                changes[key] = int(float(value)) if kind is int else kind(value)
        else:
            raise ValueError(f"--opt {key}: unknown setting; see experiments/bench/asynchrony.py")
    return replace(base, **changes)


# -- speeds and experiments ----------------------------------------------------------------------


def node_delays(node_ids: list[str], s: Settings) -> dict[str, float]:
    """Seconds of compute per task for each node: lognormal, a seeded `slow_share` of them x slow_factor."""
    from fedmq.fedcore.seeding import stream

    rng = stream(s.seed, "bench-async-speeds", len(node_ids))
    delays = s.median_s * rng.lognormal(0.0, s.sigma, size=len(node_ids))
    slow = rng.choice(len(node_ids), size=max(1, round(s.slow_share * len(node_ids))), replace=False)
    delays[slow] *= s.slow_factor
    return {node: round(float(d), 4) for node, d in zip(node_ids, delays, strict=True)}


@dataclass(frozen=True, slots=True)
class Method:
    label: str
    buffer: int | None = None
    """None: synchronous rounds; 1: FedAsync; > 1: FedBuff."""
    over_selection: float = 1.3
    server_lr: float = 1.0
    versions_per_round: int = 1
    eval_every: int = 1
    max_staleness: int = 20


SYNC = Method("FedAvg, sync (over-selection 1.3)")
SYNC_PLAIN = Method("FedAvg, sync (no over-selection: waits for stragglers)", over_selection=1.0)
FEDASYNC = Method(
    "FedAsync (K = 1, alpha = 0.6)", buffer=1, server_lr=0.6, versions_per_round=20, eval_every=10, max_staleness=100
)
FEDBUFF = Method("FedBuff (K = 5)", buffer=5, versions_per_round=4, eval_every=2)


def experiment(
    method: Method,
    s: Settings,
    *,
    nodes: int,
    rounds: int,
    concurrency: int,
    kind: str,
    name: str,
    algorithm: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """The quickstart's federation with every node's compute time as a fault delay."""
    data: dict[str, Any] = {
        "name": name,
        "seed": s.seed,
        "nodes": nodes,
        "eval_every": method.eval_every,
        "data": {"dataset": "digits"},
        "partition": {"kind": "dirichlet", "alpha": 0.3, "min_samples": 10},
        "model": {"name": "cnn"},
        "method": algorithm or {"name": "fedavg"},
        "train": {"local_epochs": 2, "batch_size": 16, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
        "policy": {
            "fraction": 0.25,
            "deadline_s": s.deadline_s,
            "over_selection": method.over_selection,
            "wait_for_nodes_s": 300,
        },
        "bus": {"protocol": "5" if kind == "mosquitto" else "3.1.1"},
        "hosting": {"processes": 2},
    }
    ids = parse_config({**data, "rounds": 1}).node_ids()
    data["faults"] = {node: {"delay_s": delay} for node, delay in node_delays(ids, s).items()}
    if method.buffer is None:
        data["rounds"] = rounds
    else:
        data["engine"] = {
            "kind": "async",
            "buffer": method.buffer,
            "concurrency": concurrency,
            "max_staleness": method.max_staleness,
            "staleness": {"fn": "polynomial", "a": 0.5},
            "server_lr": method.server_lr,
            "aggregations": method.versions_per_round * rounds,
            "deadline_s": s.deadline_s,
        }
    return parse_config(data)


# -- running and reading a federation --------------------------------------------------------------


@dataclass
class Outcome:
    """What one run measured, read from its metrics lines and summary."""

    label: str
    lines: list[dict[str, Any]]
    summary: dict[str, Any]
    wall_s: float
    cpu: CpuSampler | None = None

    @property
    def cpu_s(self) -> dict[str, float]:
        return self.cpu.seconds if self.cpu is not None else {}

    @property
    def startup_s(self) -> float:
        return float(self.summary.get("startup_seconds") or 0.0)

    @property
    def curve(self) -> list[tuple[float, float]]:
        """(seconds since the first task, accuracy) of every evaluated line."""
        return [(r["ended_s"] - self.startup_s, float(r["accuracy"])) for r in self.lines if "accuracy" in r]

    @property
    def final(self) -> tuple[float, float]:
        return self.curve[-1]

    @property
    def best(self) -> tuple[float, float]:
        return max(self.curve, key=lambda p: (p[1], -p[0]))

    def time_to(self, accuracy: float) -> float | None:
        return next((t for t, a in self.curve if a >= accuracy), None)

    @property
    def asynchronous(self) -> bool:
        return self.summary.get("engine") == "async" or "folded" in self.lines[0]

    def work(self) -> tuple[int, int, dict[str, int]]:
        """(tasks sent, updates folded, why the others were not folded)."""
        why: dict[str, int] = {}
        if self.asynchronous:
            folded = sum(len(r.get("folded", ())) for r in self.lines)
            for key in ("stale", "expired", "lost", "rejected", "failed"):
                why[key] = sum(int(r.get(key, 0)) for r in self.lines)
            why["in flight at the end"] = int(self.summary.get("in_flight_at_end", 0))
            why["buffered at the end"] = int(self.summary.get("buffered_at_end", 0))
            return folded + sum(why.values()), folded, why
        sent = sum(len(r["selected"]) for r in self.lines)
        folded = sum(len(r["accepted"]) + len(r.get("late_folded", ())) for r in self.lines if r.get("aggregated"))
        for key, name in (("late", "late (over-selected)"), ("lost", "lost"), ("rejected", "rejected")):
            why[name] = sum(len(r.get(key, ())) for r in self.lines)
        why["failed"] = sum(len(r.get("failed", ())) for r in self.lines)
        why["not aggregated"] = sum(len(r["accepted"]) for r in self.lines if not r.get("aggregated"))
        return sent, folded, why


def run_real(cfg: ExperimentConfig, url: str, out: Path, label: str, *, processes: int = 2) -> Outcome:
    """`fedmq run`'s processes: the broker at `url`, the coordinator, `processes` node hosts."""
    from fedmq.experiments.runner import run_federation

    started = time.monotonic()
    with CpuSampler() as cpu:
        code = asyncio.run(run_federation(cfg, out, broker=url, processes=processes, quiet=True))
    wall = time.monotonic() - started
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if code != 0 or summary.get("state") != "finished":
        raise RuntimeError(f"the benchmark federation {cfg.name} failed (exit {code}); see {out / 'logs'}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return Outcome(label, lines, summary, wall, cpu)


def run_virtual(cfg: ExperimentConfig, label: str) -> Outcome:
    """The same experiment on the engine's in-process driver, the fault delays as compute times."""
    import torch

    from fedmq.experiments.local import build_local, fault_delays

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each node host and the coordinator of `fedmq run` train
    quiet = logging.getLogger("fedmq.coordinator")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # late and stale updates are expected here, by the hundred
    try:
        started = time.monotonic()
        federation = build_local(cfg, compute_s=fault_delays(cfg), device=torch.device("cpu"))
        lines = federation.run()
        summary = dict(federation.engine.summary_fields())
        summary["engine"] = cfg.engine.kind
        return Outcome(label, [dict(r) for r in lines], summary, time.monotonic() - started)
    finally:
        torch.set_num_threads(threads)
        quiet.setLevel(level)


class CpuSampler:
    """CPU seconds (user + system) of each role of the processes below this one (the broker, the
    coordinator, the node hosts), sampled from /proc every `interval_s`."""

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self._series: dict[tuple[int, str], tuple[str, list[tuple[float, float]]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-sampler")
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def seconds(self) -> dict[str, float]:
        """Each role's CPU seconds over the run (to each process's last sample)."""
        out: dict[str, float] = {}
        for which, series in self._series.values():
            out[which] = round(out.get(which, 0.0) + series[-1][1], 2)
        return out

    def busy(self, which: str, window_s: float) -> float:
        """Cores the role kept busy on average over the last `window_s` seconds it ran."""
        runs = [series for name, series in self._series.values() if name == which]
        if not runs or window_s <= 0:
            return math.nan
        end = max(series[-1][0] for series in runs)
        used = 0.0
        for series in runs:
            before = [cpu for t, cpu in series if t <= end - window_s]
            used += series[-1][1] - (before[-1] if before else 0.0)
        return used / window_s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            for pid in descendants(os.getpid()):
                which = role(pid)
                if which is None:
                    continue
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                cpu = (int(fields[11]) + int(fields[12])) / self._tick
                self._series.setdefault((pid, fields[19]), (which, []))[1].append((now, cpu))


# -- the sections ----------------------------------------------------------------------------------


def compare(report: Report, section: str, base: Outcome, others: list[Outcome]) -> dict[str, Any]:
    """Time to the baseline's final accuracy, final accuracies and wasted updates, each as ratios to the baseline."""
    target = base.final[1]
    base_t = base.time_to(target)
    assert base_t is not None  # its own final line reaches it
    out: dict[str, Any] = {"target_accuracy": target, "runs": {}}
    rows = [base, *others]
    for run in rows:
        t = run.time_to(target)
        best_t, best_a = run.best
        ratio = base_t / t if t is not None and t > 0 else None
        note = "the target: its final accuracy" if run is base else ""
        if t is None:
            note = f"not reached; best {best_a:.3f} at {best_t:.1f} s"
        report.add(
            run.label, t if t is not None else math.nan, "s", ratio=ratio, ratio_means="faster than sync",
            note=note, section=f"{section}: time to sync's final accuracy {target:.3f}",
        )  # fmt: skip
        out["runs"][run.label] = {
            "time_to_target_s": t,
            "ratio": ratio,
            "final_accuracy": run.final[1],
            "final_s": run.final[0],
            "best_accuracy": best_a,
            "best_s": best_t,
            "wall_s": round(run.wall_s, 2),
            "cpu_s": run.cpu_s,
        }
    for run in rows:
        final_t, final_a = run.final
        report.add(
            run.label, final_a, "", ratio=final_a / target, ratio_means="sync's", note=f"at {final_t:.1f} s",
            section=f"{section}: final accuracy",
        )  # fmt: skip
    base_share = _share(base)
    for run in rows:
        sent, folded, why = run.work()
        wasted = sent - folded
        share = wasted / sent if sent else 0.0
        detail = ", ".join(f"{k} {v}" for k, v in why.items() if v)
        report.add(
            run.label, wasted, "updates", ratio=share / base_share if base_share else None,
            ratio_means="sync's wasted share", note=f"{share:.0%} of {sent} sent; {detail or 'none'}",
            section=f"{section}: updates wasted (sent, never folded)",
        )  # fmt: skip
        out["runs"][run.label] |= {"sent": sent, "folded": folded, "wasted": wasted, "wasted_by_reason": why}
    return out


def _share(run: Outcome) -> float:
    sent, folded, _ = run.work()
    return (sent - folded) / sent if sent else 0.0


def speed_comparison(
    report: Report, options: BenchOptions, s: Settings, url: str | None, kind: str, *, real: bool
) -> dict[str, Any]:
    where = "bus" if real else "virtual time"
    methods = [SYNC, FEDASYNC, FEDBUFF] + ([SYNC_PLAIN] if s.plain_on_bus or not real else [])
    outcomes = []
    for method in methods:
        cfg = experiment(
            method, s, nodes=s.nodes, rounds=s.rounds, concurrency=s.concurrency, kind=kind,
            name=f"bench-async-{_slug(method)}",
        )  # fmt: skip
        if real:
            assert url is not None
            out = options.work_dir / "async" / f"{_slug(method)}-{time.strftime('%H%M%S')}"
            outcomes.append(run_real(cfg, url, out, method.label, processes=s.processes))
        else:
            outcomes.append(run_virtual(cfg, method.label))
    return compare(report, where, outcomes[0], outcomes[1:])


def _slug(method: Method) -> str:
    if method.buffer is None:
        return "sync" if method.over_selection > 1 else "sync-plain"
    return "fedasync" if method.buffer == 1 else f"fedbuff{method.buffer}"


def ingest(report: Report, options: BenchOptions, s: Settings, url: str, kind: str) -> dict[str, Any]:
    """Updates folded per second by the async coordinator (noop, tiny MLP) beside sync noop rounds at C = 1."""
    n = s.ingest_nodes
    results: dict[str, Any] = {}
    rounds = 12 if not options.quick else 5
    sync_cfg = noop_workload(n, 1.0, rounds, kind=kind, name="bench-async-ingest-sync")
    out = options.work_dir / "async" / f"ingest-sync-{n}-{time.strftime('%H%M%S')}"
    sync = run_real(sync_cfg, url, out, "sync", processes=s.processes)
    times = round_times(out)
    per_round = statistics.median(times)
    selected = statistics.median(len(r["selected"]) for r in sync.lines)
    sync_rate = selected / per_round
    results["sync"] = {"seconds_per_round": per_round, "selected": selected, "updates_per_s": sync_rate}
    section = f"ingest: {n} noop nodes, MLP of 442 parameters"
    for k, receipts in ((10, "all"), (10, "refusals"), (1, "all")):
        key = f"k{k}" + ("" if receipts == "all" else "-refusals")
        versions = max(10, s.ingest_updates // k // (3 if k == 1 else 1))
        base = noop_workload(n, 1.0, 1, kind=kind, name=f"bench-async-ingest-{key}").model_dump(mode="json")
        base |= {"rounds": None, "eval_every": versions}
        base["policy"] = {**base["policy"], "receipts": receipts}
        base["engine"] = {
            "kind": "async", "buffer": k, "concurrency": n, "max_staleness": 1_000_000,
            "aggregations": versions, "deadline_s": 120,
        }  # fmt: skip
        cfg = parse_config(base)
        out = options.work_dir / "async" / f"ingest-{key}-{n}-{time.strftime('%H%M%S')}"
        run = run_real(cfg, url, out, f"K = {k}", processes=s.processes)
        warm = len(run.lines) // 10
        span = run.lines[-1]["ended_s"] - run.lines[warm]["ended_s"]
        folded = sum(len(r["folded"]) for r in run.lines[warm + 1 :])
        rate = folded / span if span > 0 else math.nan
        busy = run.cpu.busy("coordinator", span) if run.cpu is not None else math.nan
        cpu_ms = busy * span / folded * 1e3 if folded else math.nan  # the coordinator's CPU per folded update
        staleness = max(r["staleness_max"] for r in run.lines)
        backlog = int(run.summary.get("buffered_at_end", 0))
        note = (
            f"{folded} folded in {span:.2f} s; coordinator {busy:.0%} of a core, {cpu_ms:.2f} ms of CPU an update;"
            f" staleness up to {staleness}"
        )
        if backlog:
            note += f"; {backlog} accepted updates still buffered at the end"
        label = "FedBuff" if k > 1 else "FedAsync"
        label += "" if receipts == "all" else ", receipts for refusals only"
        report.add(
            f"async coordinator, {label} K = {k}, concurrency {n}", rate, "updates/s", ratio=rate / sync_rate,
            ratio_means="the sync rounds' updates/s", note=note, section=section,
        )  # fmt: skip
        results[key] = {
            "updates_per_s": rate,
            "folded": folded,
            "span_s": span,
            "versions": versions,
            "max_staleness_seen": staleness,
            "buffered_at_end": backlog,
            "coordinator_cpu_share": busy,
            "coordinator_cpu_ms_per_update": cpu_ms,
            "cpu_s": run.cpu_s,
            "wall_s": run.wall_s,
        }
    report.add(
        f"sync noop rounds, C = 1 ({selected:.0f} nodes a round)", sync_rate, "updates/s", ratio=1.0,
        ratio_means="", note=f"{per_round * 1e3:.1f} ms a round (median of {len(times)})",
        section=section,
    )  # fmt: skip
    best = max(r["updates_per_s"] for k, r in results.items() if k != "sync")
    report.target(
        "async coordinator folds >= 1,000 updates/s (noop, tiny model)",
        f"{results['k10']['updates_per_s']:,.0f}/s (K = 10), {results['k10-refusals']['updates_per_s']:,.0f}/s"
        f" (K = 10, receipts for refusals only), {results['k1']['updates_per_s']:,.0f}/s (K = 1)",
        best >= 1000,
    )
    return results


def kdia(
    report: Report, options: BenchOptions, s: Settings, url: str | None, kind: str, *, real: bool
) -> dict[str, Any]:
    """KDIA synchronous against KDIA with FedBuff, on the same speed law, on the bus or in virtual time."""
    hyperparams = {"lambda_kd": 0.5, "lambda_gen": 0.01, "gen_epochs": 1, "gen_batches_per_epoch": s.kdia_gen_batches}
    algorithm = {"name": "kdia", "hyperparams": hyperparams}
    fedbuff = replace(FEDBUFF, versions_per_round=3)  # the generator trains once a version: fewer than FedAvg's
    outcomes = []
    for method, label in ((SYNC, "KDIA, sync (over-selection 1.3)"), (fedbuff, "KDIA, FedBuff (K = 5)")):
        cfg = experiment(
            method, s, nodes=s.kdia_nodes, rounds=s.kdia_rounds, concurrency=s.kdia_concurrency, kind=kind,
            name=f"bench-async-kdia-{_slug(method)}", algorithm=algorithm,
        )  # fmt: skip
        if real:
            assert url is not None
            out = options.work_dir / "async" / f"kdia-{_slug(method)}-{time.strftime('%H%M%S')}"
            outcomes.append(run_real(cfg, url, out, label, processes=s.processes))
        else:
            outcomes.append(run_virtual(cfg, label))
    result = compare(report, "KDIA, bus" if real else "KDIA, virtual time", outcomes[0], outcomes[1:])
    for run in outcomes:
        gaps = [float(r["round_seconds"]) for r in run.lines[1:] if "round_seconds" in r]
        result["runs"][run.label] |= {
            "seconds_per_version": statistics.median(gaps) if gaps else math.nan,
            "most_buffered": max((int(r.get("buffered", 0)) for r in run.lines), default=0),
        }
    return result


def speed_target(report: Report, figures: Mapping[str, Any]) -> None:
    """Against the over-selected synchronous run (the stronger baseline); plain FedAvg is in the notes."""
    ratios = {k: v["ratio"] for k, v in figures["runs"].items() if k not in (SYNC.label, SYNC_PLAIN.label)}
    measured = "; ".join(f"{k.split(' ')[0]} {_ratio(r)}" for k, r in ratios.items())
    met = any(r is not None and r >= 2 for r in ratios.values())
    report.target("async reaches sync's final accuracy >= 2x sooner (bus, sync with over-selection)", measured, met)


def run(options: BenchOptions) -> Report:
    raise_fd_limit()
    s = settings(options)
    kind = broker_kind(options)
    ids = parse_config({"name": "ids", "nodes": s.nodes, "rounds": 1}).node_ids()
    delays = sorted(node_delays(ids, s).values())
    slow = max(1, round(s.slow_share * s.nodes))
    report = Report(
        "async",
        TITLE,
        context={
            "machine": f"{machine()['cores']} cores; broker {kind}; {s.processes} node-host processes",
            "workload": f"quickstart's (digits, Dirichlet 0.3, CNN, 2 local epochs), {s.nodes} nodes, seed {s.seed}",
            "speeds": (
                f"lognormal compute times, median {s.median_s:g} s, sigma {s.sigma:g}, {slow} seeded nodes "
                f"x{s.slow_factor:g}: {delays[0]:.2f} to {delays[-slow - 1]:.2f} s, slow "
                + ", ".join(f"{d:.1f}" for d in delays[-slow:])
                + " s"
            ),
            "sync": f"FedAvg C = 0.25, over-selection 1.3, deadline {s.deadline_s:g} s, {s.rounds} rounds",
            "async": (
                f"concurrency {s.concurrency}, s(tau) = (1 + tau)^-0.5; FedAsync K = 1, alpha 0.6, max_staleness "
                f"{FEDASYNC.max_staleness}, {FEDASYNC.versions_per_round * s.rounds} versions; FedBuff K = 5, "
                f"server_lr 1, max_staleness {FEDBUFF.max_staleness}, {FEDBUFF.versions_per_round * s.rounds} versions"
            ),
            "times": "seconds since the first task (ended_s - startup_seconds)",
            "figures": {},
        },
    )
    figures: dict[str, Any] = report.context["figures"]
    bus_sections = {"real", "ingest"} | ({"kdia"} if s.kdia_on_bus else set())
    if bus_sections & set(s.sections):
        with running_broker(options) as url:
            if "real" in s.sections:
                figures["real"] = speed_comparison(report, options, s, url, kind, real=True)
                speed_target(report, figures["real"])
            if "virtual" in s.sections:
                figures["virtual"] = speed_comparison(report, options, s, None, kind, real=False)
            if "ingest" in s.sections:
                figures["ingest"] = ingest(report, options, s, url, kind)
            if "kdia" in s.sections and s.kdia_on_bus:
                figures["kdia_real"] = kdia(report, options, s, url, kind, real=True)
    elif "virtual" in s.sections:
        figures["virtual"] = speed_comparison(report, options, s, None, kind, real=False)
    if "kdia" in s.sections:
        figures["kdia_virtual"] = kdia(report, options, s, None, kind, real=False)
    report.notes += notes(figures)
    return report


def notes(figures: Mapping[str, Any]) -> list[str]:
    """What the figures say beyond the rows: plain FedAvg's time, KDIA's coordinator, the ingest backlog."""
    out = []
    for key, where in (("real", "on the bus"), ("virtual", "in virtual time")):
        runs = figures.get(key, {}).get("runs", {})
        plain = runs.get(SYNC_PLAIN.label, {}).get("time_to_target_s")
        if not plain:
            continue
        faster = [
            f"{label.split(' ')[0]} {plain / v['time_to_target_s']:.1f}x"
            for label, v in runs.items()
            if v.get("time_to_target_s") and label not in (SYNC.label, SYNC_PLAIN.label)
        ]
        out.append(
            f"Against plain FedAvg (no over-selection, waiting for stragglers: {plain:.1f} s to the same target "
            f"{where}) the asynchronous runs are {', '.join(faster)} sooner; over-selection alone recovers most "
            "of what stragglers cost a synchronous round."
        )
    for key, where in (("kdia_real", "on the bus"), ("kdia_virtual", "in virtual time")):
        runs = figures.get(key, {}).get("runs", {})
        if len(runs) == 2:
            sync, buff = runs.values()
            waiting = f" (up to {buff['most_buffered']} updates waiting to be folded)" if buff["most_buffered"] else ""
            out.append(
                f"KDIA {where}: a version every {buff['seconds_per_version']:.2f} s with FedBuff{waiting}, a round "
                f"every {sync['seconds_per_version']:.2f} s synchronously; the generator trains once per version."
            )
    ingest_fig = figures.get("ingest")
    if ingest_fig:
        for key, r in ingest_fig.items():
            if key != "sync" and r["buffered_at_end"]:
                out.append(
                    f"Ingest {key}: {r['buffered_at_end']} accepted updates were still buffered at the end"
                    " (the engine folds everything accepted into the last version: this would be a bug)."
                )
    return out


def _ratio(r: float | None) -> str:
    return "not reached" if r is None else f"{r:.2f}x"
