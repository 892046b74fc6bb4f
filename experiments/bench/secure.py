"""What secure aggregation costs: round time and bytes per node, secure against plain, in one run.

Real federations (`fedmq run`'s processes: a broker, the coordinator, two node-host processes) run
FedAvg's averaging with the `noop` method (each node sends back the model it received: no training,
so what is timed is the protocol) on an MLP of about 50,000 parameters, every node selected, three
ways: plain, SecAgg (every other node a neighbour) and SecAgg+ (a ring of `neighbours`). A round's
time is the median between the ends of consecutive rounds after warm-up; bytes per node are the
coordinator's bytes in and out over the run, per round and selected node. Each secure figure is a
ratio to the plain round of the same size, measured in the same run on the same broker.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from fedmq.experiments.bench.brokers import broker_kind, raise_fd_limit, running_broker
from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.rounds import round_times, run_one
from fedmq.experiments.config import ExperimentConfig, parse_config

TITLE = "secure aggregation's cost: round time and bytes per node against the plain round, 10 and 100 selected"

HIDDEN = 64
"""The MLP's hidden width: 784-free synthetic inputs of 700 features, 700 x 64 + 64 x 10 = 45,514 parameters."""
FEATURES = 700


def workload(nodes: int, rounds: int, *, kind: str, secure: dict[str, Any] | None) -> ExperimentConfig:
    mode = "plain" if secure is None else f"secure-{secure.get('neighbours', 0)}"
    return parse_config(
        {
            "name": f"bench-secure-{nodes}-{mode}",
            "seed": 0,
            "nodes": nodes,
            "rounds": rounds,
            "eval_every": rounds,
            "data": {
                "dataset": "synthetic",
                "options": {"train_size": max(2000, 8 * nodes), "test_size": 200, "features": FEATURES},
            },
            "partition": {"kind": "iid"},
            "model": {"name": "mlp", "options": {"hidden": [HIDDEN]}},
            "method": {"name": "noop"},
            "policy": {"deadline_s": 300, "fraction": 1.0, "wait_for_nodes_s": 600, "ack_timeout_s": 60},
            "bus": {"protocol": "5" if kind == "mosquitto" else "3.1.1"},
            **({} if secure is None else {"privacy": {"secure_aggregation": {"timeout_s": 300, **secure}}}),
        }
    )


def settings(options: BenchOptions) -> tuple[list[int], int, int]:
    """(selected node counts, rounds, SecAgg+'s neighbours)."""
    if options.quick:
        return [4], 4, 2
    nodes = [int(x) for x in str(options.extra.get("nodes", "10,100")).split(",")]
    return nodes, int(options.extra.get("rounds", 6)), int(options.extra.get("neighbours", 20))


def bytes_per_node(out: Path, nodes: int) -> float:
    """The coordinator's bytes in and out, per round and selected node."""
    summary = json.loads((out / "summary.json").read_text())
    bus = summary.get("bus", {})
    rounds = max(1, int(summary.get("rounds_completed", 1)))
    return (int(bus.get("bytes_in", 0)) + int(bus.get("bytes_out", 0))) / rounds / nodes


def run(options: BenchOptions) -> Report:
    raise_fd_limit()
    kind = broker_kind(options)
    sizes, rounds, neighbours = settings(options)
    report = Report(
        "secure",
        TITLE,
        context={
            "method": "noop (each node sends back the model it received), every node selected",
            "model": f"MLP {FEATURES}-{HIDDEN}-10 ({FEATURES * HIDDEN + HIDDEN + HIDDEN * 10 + 10:,} parameters)",
            "broker": kind,
            "processes": "broker, coordinator, 2 node hosts",
            "rounds": f"{rounds} (2 warm-up)",
            "statistic": "median time between round ends; the coordinator's bytes per round and node",
        },
    )
    modes: list[tuple[str, dict[str, Any] | None]] = [
        ("plain", None),
        ("SecAgg (every other node a neighbour)", {"neighbours": 0}),
        (f"SecAgg+ ({neighbours} neighbours)", {"neighbours": neighbours}),
    ]
    figures: dict[str, Any] = {}
    rows: list[tuple[tuple[str, str, float, str, float | None, str], ...]] = []
    with running_broker(options) as url:
        for nodes in sizes:
            plain_time = plain_bytes = float("nan")
            for label, secure in modes:
                if secure is not None and secure["neighbours"] >= nodes - 1 and secure["neighbours"] != 0:
                    continue  # SecAgg+ with as many neighbours as SecAgg is SecAgg
                cfg = workload(nodes, rounds, kind=kind, secure=secure)
                out = options.work_dir / "secure" / f"{cfg.name}-{time.strftime('%H%M%S')}"
                result = run_one(cfg, url, out)
                seconds, size = result["seconds_per_round"], bytes_per_node(out, nodes)
                if secure is None:
                    plain_time, plain_bytes = seconds, size
                figures[f"{nodes}-{label}"] = result | {"bytes_per_node": size, "round_times": round_times(out)}
                against = None if secure is None else "the plain round"
                rows.append(
                    (
                        ("time per round", f"{nodes} selected, {label}", seconds * 1e3, "ms",
                         None if secure is None else seconds / plain_time, against or ""),
                        ("bytes per node and round", f"{nodes} selected, {label}", size / 1e3, "kB",
                         None if secure is None else size / plain_bytes, against or ""),
                    )
                )  # fmt: skip
    for index in (0, 1):  # every time, then every size: one table section each
        for section, label, value, unit, ratio, means in (row[index] for row in rows):
            report.add(label, value, unit, section=section, ratio=ratio, ratio_means=means)
    report.context["figures"] = figures
    report.notes.append(
        "The secure round adds three exchanges (keys, shares, reveals) and the coordinator's unmasking; its"
        " update is one int32 vector, as many bytes as the float32 model. SecAgg's Shamir sharing grows with the"
        " square of the neighbours (pycryptodome's pure-Python polynomials): SecAgg+ keeps it to a ring."
    )
    if figures:
        report.context["median_round_s"] = {k: statistics.median(v["round_times"] or [0]) for k, v in figures.items()}
    return report
