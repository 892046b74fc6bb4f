"""Round overhead: everything a round costs that is not training, with 10, 100 and 1000 node daemons.

Real federations (`fedmq run`'s processes: a broker, the coordinator, two node-host processes with
one MQTT connection per node) run the `noop` method on a tiny model: each selected node receives
the task and the model and sends the model straight back, and the coordinator aggregates,
checkpoints and publishes its status as in any run. The overhead of a round is the median time
between the ends of consecutive rounds (the metrics' ``ended_s``), after a warm-up round.

Beside it, measured on the same broker in the same run: the round trip of a small message between
two processes through the broker (the transport suite's), the floor of any round, which must at
least send a task and receive an update. Each round's time is reported as a multiple of it, a
ratio that holds on a loaded machine where the absolute times drift.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from fedmq.experiments.bench.brokers import broker_kind, raise_fd_limit, running_broker
from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.transport import bus_round_trip
from fedmq.experiments.config import ExperimentConfig, parse_config

TITLE = "round overhead without training: 10, 100 and 1000 nodes at C = 0.1 and C = 1.0"

WARMUP_ROUNDS = 2


def workload(nodes: int, fraction: float, rounds: int, *, kind: str, name: str = "bench-rounds") -> ExperimentConfig:
    """The noop federation: synthetic data (a few samples a node), the MLP with one hidden layer of 16."""
    return parse_config(
        {
            "name": f"{name}-{nodes}-{fraction:g}",
            "seed": 0,
            "nodes": nodes,
            "rounds": rounds,
            "eval_every": rounds,
            "data": {
                "dataset": "synthetic",
                "options": {"train_size": max(2000, 4 * nodes), "test_size": 200, "features": 16},
            },
            "partition": {"kind": "iid"},
            "model": {"name": "mlp", "options": {"hidden": [16]}},
            "method": {"name": "noop"},
            "policy": {"fraction": fraction, "deadline_s": 120, "wait_for_nodes_s": 600, "ack_timeout_s": 30},
            # the embedded broker speaks 3.1.1 only: naming it spares a probe connection per node
            "bus": {"protocol": "5" if kind == "mosquitto" else "3.1.1"},
        }
    )


def settings(options: BenchOptions) -> tuple[list[int], list[float], int]:
    if options.quick:
        return [4], [0.5], 5
    nodes = [int(x) for x in str(options.extra.get("nodes", "10,100,1000")).split(",")]
    fractions = [float(x) for x in str(options.extra.get("fractions", "0.1,1.0")).split(",")]
    return nodes, fractions, int(options.extra.get("rounds", 12))


def round_times(run_dir: Path) -> list[float]:
    """Seconds between the ends of consecutive aggregated rounds, after the warm-up rounds."""
    ends = [
        r["ended_s"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r.get("aggregated") and "ended_s" in r
    ]
    return [b - a for a, b in zip(ends[WARMUP_ROUNDS:], ends[WARMUP_ROUNDS + 1 :], strict=False)]


def run_one(cfg: ExperimentConfig, url: str, out: Path, processes: int = 2) -> dict[str, Any]:
    from fedmq.experiments.runner import run_federation

    started = time.monotonic()
    code = asyncio.run(run_federation(cfg, out, broker=url, processes=processes, quiet=True))
    wall = time.monotonic() - started
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if code != 0 or summary.get("state") != "finished":
        raise RuntimeError(f"the benchmark federation {cfg.name} failed (exit {code}); see {out / 'logs'}")
    times = round_times(out)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    selected = [len(r["selected"]) for r in records]
    return {
        "seconds_per_round": statistics.median(times),
        "rounds_timed": len(times),
        "selected_per_round": statistics.median(selected),
        "cpu_ms_per_update": cpu_per_update(records) * 1e3,
        "wall_s": wall,
        "rejected": summary.get("bus", {}).get("rejected", {}),
    }


def cpu_per_update(records: list[dict[str, Any]]) -> float:
    """The coordinator's CPU seconds (all its threads) per accepted update, over the rounds after the
    warm-up: the growth of the metrics' ``cpu_s`` over the updates those rounds accepted."""
    timed = [r for r in records if r.get("aggregated") and "cpu_s" in r][WARMUP_ROUNDS:]
    updates = sum(len(r["accepted"]) for r in timed[1:])
    return (timed[-1]["cpu_s"] - timed[0]["cpu_s"]) / updates if len(timed) > 1 and updates else float("nan")


def run(options: BenchOptions) -> Report:
    raise_fd_limit()
    kind = broker_kind(options)
    nodes_list, fractions, rounds = settings(options)
    report = Report(
        "rounds",
        TITLE,
        context={
            "method": "noop (nodes send the received model back)",
            "model": "MLP 16-16-10 (442 parameters)",
            "broker": kind,
            "processes": "broker, coordinator, 2 node hosts",
            "rounds": f"{rounds} ({WARMUP_ROUNDS} warm-up)",
            "statistic": "median time between round ends",
        },
    )
    results: dict[tuple[int, float], dict[str, Any]] = {}
    with running_broker(options) as url:
        floor = statistics.median(bus_round_trip(url, 20 if options.quick else 200))
        report.add(
            "a small message's round trip through the broker (the floor)", floor * 1e3, "ms",
            section="time per round", note="two processes, QoS 1",
        )  # fmt: skip
        for nodes in nodes_list:
            for fraction in fractions:
                cfg = workload(nodes, fraction, rounds, kind=kind)
                out = options.work_dir / "rounds" / f"{nodes}-{fraction:g}-{time.strftime('%H%M%S')}"
                result = results[nodes, fraction] = run_one(cfg, url, out)
                seconds = result["seconds_per_round"]
                report.add(
                    f"{nodes} nodes, C = {fraction:g}", seconds * 1e3, "ms",
                    ratio=seconds / floor, ratio_means="the broker's round trip",
                    note=f"{result['selected_per_round']:.0f} selected; {1 / seconds:.1f} rounds/s",
                    section="time per round",
                )  # fmt: skip
        by_selected = sorted(results.values(), key=lambda r: r["selected_per_round"])
        smallest = by_selected[0] if by_selected else None
        ordered = sorted(results.items(), key=lambda kv: kv[1]["selected_per_round"])
        for (nodes, fraction), result in ordered:
            assert smallest is not None
            k = result["selected_per_round"]
            report.add(
                f"{k:.0f} selected ({nodes} nodes, C = {fraction:g})", result["seconds_per_round"] * 1e3, "ms",
                ratio=result["seconds_per_round"] / smallest["seconds_per_round"],
                ratio_means=f"the round with {smallest['selected_per_round']:.0f} selected",
                note=f"{k / smallest['selected_per_round']:.0f}x the nodes", section="time per round by nodes selected",
            )  # fmt: skip
        for _, result in ordered:
            k = result["selected_per_round"]
            report.add(
                f"coordinator CPU per accepted update, {k:.0f} selected", result["cpu_ms_per_update"], "ms",
                section="the coordinator's CPU", note="its process, every thread, over the timed rounds",
            )  # fmt: skip
    key = (100, 0.1)
    if key in results:
        ms = results[key]["seconds_per_round"] * 1e3
        report.target(
            "round overhead below 20 ms for 100 nodes at C = 0.1",
            f"{ms:.1f} ms ({ms / floor / 1e3:.0f}x the floor)",
            ms < 20,
        )
    by_k = {round(r["selected_per_round"]): r for r in results.values()}
    if 10 in by_k and 1000 in by_k:
        growth = by_k[1000]["seconds_per_round"] / by_k[10]["seconds_per_round"]
        report.target("a round with 1,000 selected costs at most 10x one with 10", f"{growth:.1f}x", growth <= 10)
    if 1000 in by_k:
        cpu = by_k[1000]["cpu_ms_per_update"]
        report.target(
            "the coordinator's CPU per accepted update under 0.2 ms (1,000 selected)", f"{cpu:.3f} ms", cpu < 0.2
        )
    report.context["figures"] = {f"{n}-{c:g}": r for (n, c), r in results.items()}
    return report
