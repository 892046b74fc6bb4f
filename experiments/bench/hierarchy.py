"""Hierarchical aggregation against one flat federation: the bytes into the central broker, the
coordinator's CPU a round, and the accuracy, side by side.

The same FedAvg federation (1,000 nodes by default, every node in every round, the MLP with one
hidden layer of 16 on synthetic data) runs twice on this machine, each time on a fresh central
mosquitto: flat, every node connected to it; and in 10 sites, each a mosquitto bridged to it
(`broker.servers.bridge`) with its aggregator and a node host, the nodes connected to their site's broker
only. The central broker's own counter (``$SYS/broker/bytes/received``, published every second)
gives the bytes it received over each run; the coordinator's metrics lines (``cpu_s``) its CPU over
the rounds after the warm-up; both runs' accuracy, round for round, is reported beside.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiomqtt

from fedmq.experiments.bench.brokers import raise_fd_limit, running_broker
from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.rounds import WARMUP_ROUNDS, round_times
from fedmq.experiments.bench.rounds import workload as rounds_workload
from fedmq.experiments.config import ExperimentConfig, merge, parse_config

TITLE = "hierarchical aggregation over bridged brokers vs flat: bytes into the central broker, coordinator CPU"

SYS_BYTES = "$SYS/broker/bytes/received"


def workload(nodes: int, rounds: int, sites: int) -> ExperimentConfig:
    """`fedmq bench rounds`'s federation with FedAvg training, C = 1 (both runs train the same nodes from
    the same models), more data a node, an evaluation every round, and `sites` sites."""
    base = rounds_workload(nodes, 1.0, rounds, kind="mosquitto", name="bench-hierarchy").model_dump(mode="json")
    changes = {
        "name": f"bench-hierarchy-{nodes}-{sites}",
        "eval_every": 1,
        "data": {"options": {"train_size": max(2000, 8 * nodes), "test_size": 500}},
        "method": {"name": "fedavg"},
        "train": {"local_epochs": 1, "batch_size": 8, "lr": 0.1},
        "policy": {"deadline_s": 300, "wait_for_nodes_s": 900, "ack_timeout_s": 60},
        "hierarchy": {"sites": sites},
    }
    return parse_config(merge(base, changes))


def settings(options: BenchOptions) -> tuple[int, int, int]:
    if options.quick:
        return 20, 2, 4
    extra = options.extra
    return int(extra.get("hierarchy_nodes", 1000)), int(extra.get("sites", 10)), int(extra.get("hierarchy_rounds", 8))


async def broker_bytes_received(url: str) -> int:
    """The broker's count of bytes received since it started (mosquitto's $SYS tree, retained)."""
    parts = urlsplit(url)
    async with aiomqtt.Client(parts.hostname or "127.0.0.1", parts.port or 1883) as client:
        await client.subscribe(SYS_BYTES)
        async with asyncio.timeout(15):
            async for message in client.messages:
                return int(bytes(message.payload).decode())  # type: ignore[arg-type]
    raise RuntimeError(f"{url} published no {SYS_BYTES}")


def run_one(cfg: ExperimentConfig, url: str, out: Path, processes: int) -> dict[str, Any]:
    from fedmq.experiments.runner import run_federation

    before = asyncio.run(broker_bytes_received(url))
    started = time.monotonic()
    code = asyncio.run(run_federation(cfg, out, broker=url, processes=processes, quiet=True))
    wall = time.monotonic() - started
    time.sleep(2.5)  # the broker publishes its counter every second
    received = asyncio.run(broker_bytes_received(url)) - before
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    if code != 0 or summary.get("state") != "finished":
        raise RuntimeError(f"the benchmark federation {cfg.name} failed (exit {code}); see {out / 'logs'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("aggregated")][WARMUP_ROUNDS:]
    cpu = (timed[-1]["cpu_s"] - timed[0]["cpu_s"]) / (len(timed) - 1) if len(timed) > 1 else float("nan")
    return {
        "bytes_in": received,
        "bytes_per_round": received / len(records),
        "cpu_s_per_round": cpu,
        "seconds_per_round": statistics.median(round_times(out)),
        "accuracies": [r.get("accuracy") for r in records],
        "final_accuracy": summary.get("final_accuracy"),
        "coordinator_bytes_in": summary.get("bus", {}).get("bytes_in"),
        "wall_s": wall,
    }


def run(options: BenchOptions) -> Report:
    raise_fd_limit()
    nodes, sites, rounds = settings(options)
    report = Report(
        "hierarchy",
        TITLE,
        context={
            "method": "fedavg, C = 1, 1 local epoch",
            "model": "MLP 16-16-10 on synthetic data",
            "nodes": nodes,
            "sites": f"{sites} (a mosquitto each, bridged to the central one; an aggregator and a node host each)",
            "flat": "every node on the central mosquitto, 2 node hosts",
            "rounds": f"{rounds} ({WARMUP_ROUNDS} warm-up for the CPU and round time)",
            "bytes": f"the central broker's {SYS_BYTES} over the run (start-up included), divided by the rounds",
        },
    )
    flat_cfg = workload(nodes, rounds, sites=0)
    tiered_cfg = workload(nodes, rounds, sites=sites)
    stamp = time.strftime("%H%M%S")
    with running_broker(options, kind="mosquitto", extra="sys_interval 1\n") as url:
        flat = run_one(flat_cfg, url, options.work_dir / "hierarchy" / f"flat-{nodes}-{stamp}", processes=2)
    with running_broker(options, kind="mosquitto", extra="sys_interval 1\n") as url:
        tiered = run_one(tiered_cfg, url, options.work_dir / "hierarchy" / f"sites-{nodes}-{stamp}", processes=sites)
    section = f"{nodes} nodes: flat, and in {sites} sites"
    report.add("bytes into the central broker a round, flat", flat["bytes_per_round"] / 1e3, "kB", section=section)
    report.add(
        f"bytes into the central broker a round, {sites} sites", tiered["bytes_per_round"] / 1e3, "kB",
        ratio=tiered["bytes_per_round"] / flat["bytes_per_round"], ratio_means="the flat run's", section=section,
    )  # fmt: skip
    report.add("the coordinator's CPU a round, flat", flat["cpu_s_per_round"] * 1e3, "ms", section=section)
    report.add(
        f"the coordinator's CPU a round, {sites} sites", tiered["cpu_s_per_round"] * 1e3, "ms",
        ratio=tiered["cpu_s_per_round"] / flat["cpu_s_per_round"], ratio_means="the flat run's", section=section,
    )  # fmt: skip
    report.add("time a round, flat", flat["seconds_per_round"] * 1e3, "ms", section=section)
    report.add(
        f"time a round, {sites} sites", tiered["seconds_per_round"] * 1e3, "ms",
        ratio=tiered["seconds_per_round"] / flat["seconds_per_round"], ratio_means="the flat run's", section=section,
        note="every process on the same 2 cores: the sites' brokers and aggregators add work here",
    )  # fmt: skip
    gap = max(abs(a - b) for a, b in zip(flat["accuracies"], tiered["accuracies"], strict=True))
    report.add(
        "final accuracy, flat / sites", tiered["final_accuracy"], "",
        note=f"flat {flat['final_accuracy']:.4f}; largest gap over the rounds {gap:.4f}", section=section,
    )  # fmt: skip
    ratio = tiered["bytes_per_round"] / flat["bytes_per_round"]
    report.target("10x fewer bytes into the central broker with 10 sites", f"{1 / ratio:.1f}x fewer", ratio <= 0.1)
    report.target("accuracy equal, round for round", f"largest gap {gap:.4f}", gap <= 0.01)
    report.context["figures"] = {"flat": flat, "sites": tiered}
    return report
