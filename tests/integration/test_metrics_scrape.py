"""Prometheus metrics scraped from a live federation on a real broker: the coordinator's render() and a
node host's /metrics over HTTP, during the run (the counters grow) and at its end (they agree with
metrics.jsonl and summary.json); `fedmq node --metrics` and `fedmq run --tensorboard` as a user runs them."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import yaml

import fedmq.experiments.build
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.observers.metrics import CoordinatorMetrics
from fedmq.coordinator.observers.tensorboard import INSTALL_HINT
from fedmq.experiments.build import build_coordinator, build_nodes
from fedmq.experiments.cli import main
from fedmq.experiments.config import parse_config
from fedmq.fednode.daemon import serve_nodes
from fedmq.fednode.metrics import NodeHostMetrics, serve_metrics
from tests.helpers import Samples, parse_metrics, value
from tests.integration.federation import base_config

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
ENGINES = {
    "sync": {"rounds": 5},
    "async": {
        "rounds": None,
        "engine": {"kind": "async", "buffer": 2, "concurrency": 3, "aggregations": 6, "max_staleness": 10},
        "eval_every": 2,
    },
}


def total(samples: Samples, name: str) -> float:
    """A family's sum over its labels (the host's per-node series summed)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def count(record: dict[str, Any], key: str) -> int:
    v = record.get(key, 0)
    return len(v) if isinstance(v, list) else int(v)


@pytest.mark.slow
@pytest.mark.parametrize("engine", sorted(ENGINES))
async def test_metrics_scraped_during_a_run_grow_and_agree_with_the_metrics_lines(
    tmp_path: Path, broker_url: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After each metrics line, scrape the coordinator and the node host: rounds completed only grow,
    the nodes have sent at least what the coordinator received; at the end every counter equals what
    metrics.jsonl and summary.json say."""
    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    cfg = parse_config(base_config(nodes=4, **ENGINES[engine]))
    federation = f"it-{os.urandom(4).hex()}"
    coordinator = build_coordinator(cfg, broker_url, tmp_path / "run", federation=federation)
    metrics = CoordinatorMetrics.attach(coordinator)
    lines: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    coordinator.watchers.append(
        lambda now, event, commands: [lines.put_nowait(dict(x.record)) for x in commands if isinstance(x, c.Record)]
    )
    nodes = build_nodes(cfg, broker_url, cfg.node_ids(), federation=federation, exit_when_done=True)
    host = NodeHostMetrics(nodes)
    during: list[tuple[Samples, Samples]] = []
    async with asyncio.timeout(180), serve_metrics(host.render, "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:

        async def scrape_host() -> Samples:
            async with http.get(f"{url}/metrics") as response:
                assert response.status == 200
                return parse_metrics(await response.read())

        run = asyncio.ensure_future(asyncio.gather(coordinator.serve(), serve_nodes(nodes)))
        while not run.done():
            line = asyncio.ensure_future(lines.get())
            await asyncio.wait({line, run}, return_when=asyncio.FIRST_COMPLETED)
            if not line.done():
                line.cancel()
                break
            if coordinator.engine.finished:
                continue  # the nodes may be leaving: only scrapes of the running federation count
            mine = parse_metrics(
                metrics.render()[0]
            )  # first the coordinator, then the nodes, who sent before it received
            during.append((mine, await scrape_host()))
        summary, failed = await run
        end, end_host = parse_metrics(metrics.render()[0]), await scrape_host()

    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert failed == [] and summary.state == "finished" and len(records) == {"sync": 5, "async": 6}[engine]
    assert len(during) >= 3, "too few scrapes while the federation ran"
    completed = [value(s, "fedmq_rounds_completed_total") for s, _ in during]
    assert completed == sorted(completed) and completed[-1] > completed[0] >= 1
    for mine, nodes_now in during:
        assert value(mine, "fedmq_state", state="running") == 1 and value(mine, "fedmq_live_nodes") == 4
        assert value(mine, "fedmq_bus_connected") == 1
        assert total(nodes_now, "fedmq_node_updates_sent_total") >= value(mine, "fedmq_updates_received_total")
        assert total(nodes_now, "fedmq_node_tasks_received_total") <= total(end, "fedmq_tasks_sent_total")
        assert total(nodes_now, "fedmq_node_connected") == 4 and value(nodes_now, "fedmq_host_nodes") == 4
    sent = [total(h, "fedmq_node_updates_sent_total") for _, h in during]
    assert sent == sorted(sent) and sent[-1] > sent[0]

    # the end: the counters are the metrics lines' sums, the bus's the summary's
    assert value(end, "fedmq_state", state="finished") == 1
    assert value(end, "fedmq_rounds_completed_total") == sum(1 for r in records if r["aggregated"]) == len(records)
    assert value(end, "fedmq_model_version") == records[-1]["model_version"]
    outcomes = {"sync": ("accepted", "late", "lost", "rejected", "failed"),
                "async": ("accepted", "stale", "expired", "lost", "rejected", "failed")}[engine]  # fmt: skip
    for outcome in outcomes:
        keys = ("folded",) if (engine, outcome) == ("async", "accepted") else (outcome,)
        expected = sum(count(r, k) for r in records for k in keys)
        assert value(end, "fedmq_updates_total", outcome=outcome) == expected, outcome
    assert value(end, "fedmq_round_seconds_count") == len(records)
    assert value(end, "fedmq_round_seconds_sum") == pytest.approx(sum(r["round_seconds"] for r in records))
    evaluated = [r for r in records if "accuracy" in r]
    assert (
        value(end, "fedmq_accuracy") == evaluated[-1]["accuracy"] and value(end, "fedmq_loss") == evaluated[-1]["loss"]
    )
    assert value(end, "fedmq_best_accuracy") == max(r["accuracy"] for r in evaluated)
    folded = "folded" if engine == "async" else "accepted"
    assert value(end, "fedmq_update_staleness_count") == sum(count(r, folded) for r in records)
    if engine == "async":
        expected_sum = sum(r["staleness_mean"] * len(r["folded"]) for r in records)
        assert value(end, "fedmq_update_staleness_sum") == pytest.approx(expected_sum)
        assert value(end, "fedmq_update_staleness_bucket", le="+Inf") == sum(len(r["folded"]) for r in records)
    else:
        assert value(end, "fedmq_update_staleness_sum") == 0
    # summary.json's bus figures were taken between the last scrape in the run and the one at the end
    written = json.loads((tmp_path / "run" / "summary.json").read_text())["bus"]
    for key, name in (("bytes_in", "received_bytes"), ("bytes_out", "sent_bytes"), ("received", "received_messages")):
        name = f"fedmq_bus_{name}_total"
        assert value(during[-1][0], name) <= written[key] <= value(end, name), key
    assert value(end, "fedmq_tasks_sent_total") >= total(end_host, "fedmq_node_tasks_received_total")
    assert total(end_host, "fedmq_node_updates_sent_total") >= value(end, "fedmq_updates_received_total")
    assert value(end_host, "fedmq_host_trainings_total") >= total(end_host, "fedmq_node_updates_sent_total")
    assert value(end_host, "fedmq_host_training_seconds_total") > 0
    assert value(end_host, "fedmq_bus_sent_bytes_total") > value(end_host, "fedmq_bus_published_messages_total") > 0
    if engine == "sync":  # everyone answers every round: each task was received, each update taken
        assert value(end, "fedmq_tasks_sent_total") == total(end_host, "fedmq_node_tasks_received_total")
        for node in cfg.node_ids():
            taken = sum(node in r["accepted"] for r in records)
            assert value(end_host, "fedmq_node_updates_sent_total", node=node) == taken, node


def _wait_for_line(path: Path, prefix: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no {prefix!r} line:\n{path.read_text(errors='replace')[-3000:]}")


def _start_node_host(log: Path, broker: str, config: Path, *node_ids: str) -> subprocess.Popen[bytes]:
    ids = [arg for node in node_ids for arg in ("--node-id", node)]
    with log.open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "fedmq", "node", "--broker", broker, "--config", str(config), *ids,
             "--metrics", "127.0.0.1:0", "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
        )  # fmt: skip


@pytest.mark.slow
async def test_node_command_serves_its_nodes_metrics(tmp_path: Path, embedded_broker: str) -> None:
    """`fedmq node --metrics 127.0.0.1:0` prints where it listens; a scrape there shows its two nodes,
    each connected once it is, and what their announcements published."""
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(base_config(nodes=3, federation=f"it-{os.urandom(4).hex()}")))
    log = tmp_path / "node.err"
    proc = _start_node_host(log, embedded_broker, config, "node-000", "node-002")
    try:
        url = await asyncio.to_thread(_wait_for_line, log, "metrics: ", proc)
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
        async with aiohttp.ClientSession() as http, asyncio.timeout(60):
            while True:
                async with http.get(url) as response:
                    samples = parse_metrics(await response.read())
                if total(samples, "fedmq_node_connected") == 2 and value(samples, "fedmq_bus_published_messages_total"):
                    break
                await asyncio.sleep(0.1)
        assert value(samples, "fedmq_host_nodes") == 2
        assert {dict(k)["node"] for n, k in samples if n == "fedmq_node_connected"} == {"node-000", "node-002"}
        assert value(samples, "fedmq_node_updates_sent_total", node="node-000") == 0
        assert value(samples, "fedmq_bus_sent_bytes_total") > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_node_command_metrics_on_a_taken_port_exits_2_naming_it(
    tmp_path: Path, embedded_broker: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The address in use: exit code 2 and the address, no traceback, before any node connects (the
    broker is reachable: an unreachable one is found first, exit code 3)."""
    import socket

    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump(base_config(nodes=2)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["node", "--broker", embedded_broker, "--config", str(config), "--node-id", "node-000",
                     "--metrics", f"127.0.0.1:{port}", "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and f"--metrics 127.0.0.1:{port}: cannot listen there" in err and "Traceback" not in err


def test_node_command_metrics_with_a_bad_address_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["node", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--node-id", "node-000",
              "--metrics", "localhost:http"])  # fmt: skip
    assert exit_.value.code == 2 and "--metrics" in capsys.readouterr().err


@pytest.mark.slow
def test_run_with_tensorboard_writes_each_round_into_the_run_directory(tmp_path: Path) -> None:
    """`fedmq run --tensorboard`: OUT/tensorboard holds, per round, the accuracy, loss and accepted
    count that metrics.jsonl holds."""
    pytest.importorskip("tensorboard", reason="pip install 'fedmq[tensorboard]' for this test")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "fedmq", "run", str(QUICKSTART), "--set", "rounds=3", "--processes", "1",
         "--quiet", "--tensorboard", "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for tag, key in (("accuracy", "accuracy"), ("loss", "loss"), ("round_seconds", "round_seconds")):
        written = [(s.step, s.value) for s in events.Scalars(tag)]
        assert written == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in records], tag
    assert [(s.step, s.value) for s in events.Scalars("updates/accepted")] == [(r["round"], 5.0) for r in records]


@pytest.fixture
def no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import tensorboard` fails, as where it is not installed."""
    monkeypatch.setitem(sys.modules, "tensorboard", None)


@pytest.mark.parametrize(
    "argv",
    [
        ["coordinator", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--tensorboard"],
        ["coordinator", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--tensorboard", "tb"],
        ["run", str(QUICKSTART), "--tensorboard", "--quiet"],
    ],
    ids=["coordinator", "coordinator-dir", "run"],
)
def test_tensorboard_flag_without_tensorboard_exits_2_before_starting_anything(
    argv: list[str], no_tensorboard: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit code 2 and the pip command, no traceback, nothing written."""
    code = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and INSTALL_HINT in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_coordinator_tensorboard_flag_defaults_to_the_run_directory() -> None:
    """Bare --tensorboard is OUT/tensorboard (what `fedmq run --tensorboard` passes on); with DIR, DIR."""
    pytest.importorskip("tensorboard", reason="coordinator_flags checks it is installed")
    from fedmq.experiments.cli import build_parser
    from fedmq.experiments.runner import coordinator_flags

    base = ["coordinator", "--broker", "mqtt://x:1", "--config", "e.yaml"]
    parser = build_parser()
    assert parser.parse_args([*base, "--tensorboard", "--out", "o"]).tensorboard is True
    assert parser.parse_args([*base, "--tensorboard", "tb"]).tensorboard == Path("tb")
    assert parser.parse_args(base).tensorboard is None
    run: Any = parser.parse_args(["run", "e.yaml", "--tensorboard"])
    assert coordinator_flags(run)[-1:] == ["--tensorboard"]
    assert "--tensorboard" not in coordinator_flags(parser.parse_args(["run", "e.yaml"]))
