"""Scale: how many node daemons this machine holds on one broker while rounds go on.

The ramp runs the `noop` federation of `fedmq bench rounds` at 1% participation with more and more
node daemons (each its own MQTT connection, hosted by two processes), until a step fails or the
ramp ends. For each step: the time from the launch until every node was live, the time per round, and
the resident memory of the node hosts, the coordinator and the broker (sampled from /proc during the run).
Memory per idle node is the slope between the two largest steps that ran, so that what every
process holds anyway (the interpreter, torch) does not count.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fedmq.coordinator.storage.eventlog import FILENAME as EVENT_LOG
from fedmq.experiments.bench.brokers import broker_kind, raise_fd_limit, running_broker
from fedmq.experiments.bench.common import MIB, BenchOptions, Report
from fedmq.experiments.bench.procs import MemorySampler
from fedmq.experiments.bench.rounds import run_one, workload

TITLE = "the most node daemons on one broker, memory per idle node, rounds at 1% participation"


def steps(options: BenchOptions) -> list[int]:
    if options.quick:
        return [20, 40]
    return [int(x) for x in str(options.extra.get("scale_nodes", "1000,2000,4000")).split(",")]


def run(options: BenchOptions) -> Report:
    limit = raise_fd_limit()
    kind = broker_kind(options)
    fraction = 0.01 if not options.quick else 0.1
    rounds = int(options.extra.get("scale_rounds", 10 if not options.quick else 5))
    report = Report(
        "scale",
        TITLE,
        context={
            "method": "noop",
            "participation": f"C = {fraction:g}",
            "broker": kind,
            "node hosts": 2,
            "rounds": rounds,
            "open-file limit": limit,
        },
    )
    done: list[tuple[int, dict[str, Any], dict[str, int]]] = []
    with running_broker(options) as url:
        for nodes in steps(options):
            cfg = workload(nodes, fraction, rounds, kind=kind, name="bench-scale")
            out = options.work_dir / "scale" / f"{nodes}-{time.strftime('%H%M%S')}"
            launched = time.monotonic()
            try:
                with MemorySampler() as memory:
                    result = run_one(cfg, url, out)
            except (RuntimeError, OSError) as exc:
                report.notes.append(f"{nodes} nodes: failed ({exc}); the ramp stops here")
                break
            waited, result["startup_s"] = live_after_launch(out, launched)
            done.append((nodes, result, memory.peak))
            section = f"{nodes} node daemons"
            first = done[0][1]  # the smallest step, measured in this run: each step's growth over it
            report.add(
                "from launch until every node was live", result["startup_s"], "s", section=section,
                note=f"the coordinator waited {waited:.3f} s of it",
                **_growth(result["startup_s"], first["startup_s"], done[0][0]),
            )  # fmt: skip
            report.add(
                "time per round at 1% participation" if not options.quick else "time per round",
                result["seconds_per_round"] * 1e3, "ms", section=section,
                note=f"{result['selected_per_round']:.0f} selected",
                **_growth(result["seconds_per_round"], first["seconds_per_round"], done[0][0]),
            )  # fmt: skip
            hosts = memory.peak["node-hosts"]
            report.add("node hosts' memory (peak RSS, 2 processes)", hosts / MIB, "MiB",
                       section=section, note=f"{hosts / nodes / 1024:.0f} KiB a node, all in")  # fmt: skip
            report.add("coordinator's memory", memory.peak["coordinator"] / MIB, "MiB", section=section)
            report.add(f"{kind}'s memory", memory.peak["broker"] / MIB, "MiB", section=section)
    if len(done) >= 2:
        (n1, _, m1), (n2, _, m2) = done[-2], done[-1]
        per_node = (m2["node-hosts"] - m1["node-hosts"]) / (n2 - n1)
        per_conn = (m2["broker"] - m1["broker"]) / (n2 - n1)
        report.add("memory per idle node daemon (slope)", per_node / 1024, "KiB", section="per node",
                   note=f"between {n1} and {n2} nodes")  # fmt: skip
        report.add(f"{kind}'s memory per connection (slope)", per_conn / 1024, "KiB", section="per node")
    most = max((n for n, _, _ in done), default=0)
    report.add("most node daemons that ran rounds here", most, "nodes", section="per node")
    report.target("1,000 connected node daemons on this machine", f"{most:,} ran rounds", most >= 1000)
    return report


def _growth(value: float | None, first: float | None, first_nodes: int) -> dict[str, Any]:
    """The ratio of a step's figure to the smallest step's, as `Report.add` keywords."""
    if not value or not first:
        return {}
    return {"ratio": value / first, "ratio_means": f"the {first_nodes:,}-node step's"}


def live_after_launch(out: Path, launched: float) -> tuple[float, float]:
    """The coordinator's wait for every node (from its `Start`), and the seconds from `launched` (this
    process's `time.monotonic()` before the federation started) until that wait ended.

    The coordinator's wait alone is no measure of the nodes' start-up: when the coordinator is the
    slower to start (a loaded machine), every node is live by its `Start` and it waits 0 s. The event
    log times `Start` on `time.monotonic()`, which one machine's processes share."""
    waited = json.loads((out / "summary.json").read_text()).get("startup_seconds")
    with (out / EVENT_LOG).open() as log:  # `Start` is the first event, on the log's second line
        start = next((line for line in map(json.loads, log) if line.get("ev") == "Start"), None)
    if waited is None or start is None:
        raise RuntimeError(f"{out}: the run has no coordinator start or no wait for its nodes on record")
    return float(waited), float(start["t"]) + float(waited) - launched
