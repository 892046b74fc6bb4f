"""The `fedmq` command line, as a user runs it: run, broker, coordinator --resume, errors, --help."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedmq.broker import BusClient, BusConfig
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, wait_for_port
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def fedmq(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


@pytest.mark.parametrize("broker", ["embedded", "mosquitto"])
def test_run_quickstart_writes_the_run_directory(tmp_path: Path, broker: str, request: pytest.FixtureRequest) -> None:
    """`fedmq run` starts everything, prints the final accuracy and writes every documented file."""
    extra = [] if broker == "embedded" else ["--broker", request.getfixturevalue("mosquitto_broker")]
    out = tmp_path / "run"
    result = fedmq("run", str(QUICKSTART), "--out", str(out), "--set", "rounds=6", "--processes", "2", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "final accuracy" in result.stdout
    for name in ["config.yaml", "metrics.jsonl", "participation.json", "summary.json", "run.json", "partition.json",
                 "partition.png", "nodes.json", "checkpoint.safetensors", "logs/coordinator.log", "logs/nodes-0.log"]:  # fmt: skip
        assert (out / name).exists(), name
    summary = json.loads((out / "summary.json").read_text())
    for key in ["method", "nodes", "rounds_completed", "final_accuracy", "best_accuracy", "wall_seconds"]:
        assert key in summary
    assert (summary["method"], summary["nodes"], summary["rounds_completed"]) == ("fedavg", 20, 6)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == list(range(6))
    assert all(len(m["selected"]) == 5 for m in lines)
    assert f"final accuracy {summary['final_accuracy']:.4f}" in result.stdout
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["rounds"] == 6 and resolved["federation"].startswith("quickstart-")
    partition = json.loads((out / "partition.json").read_text())
    assert sum(partition["sizes"].values()) == 1347 and len(partition["label_histograms"]) == 20


def test_run_with_an_invalid_config_exits_2_and_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(QUICKSTART.read_text().replace("fraction: 0.25", "fraction: 2.5"))
    result = fedmq("run", str(bad))
    assert result.returncode == 2
    assert "fraction: Input should be less than or equal to 1 (got 2.5)" in result.stderr


def test_coordinator_without_a_broker_exits_3_with_advice(tmp_path: Path) -> None:
    """(A 1 s connect timeout: the default's 10 s wait is `fedmq run`'s test, test_exit_codes.py.)"""
    result = fedmq(
        "coordinator", "--broker", f"mqtt://127.0.0.1:{free_port()}", "--config", str(QUICKSTART),
        "--out", str(tmp_path / "o"), "--connect-timeout", "1",
    )  # fmt: skip
    assert result.returncode == 3 and "fedmq broker" in result.stderr


def test_node_without_a_broker_exits_3_so_a_supervisor_restarts_it() -> None:
    """It exited 0 before, which a supervisor (systemd's Restart=on-failure) takes for a clean end."""
    url = f"mqtt://127.0.0.1:{free_port()}"
    result = fedmq(
        "node", "--broker", url, "--config", str(QUICKSTART), "--node-id", "node-000", "--node-id", "node-001",
        "--connect-timeout", "1",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert f"fedmq: broker error: broker {url} unreachable within 1 s" in result.stderr  # --connect-timeout


def test_node_with_an_unknown_id_exits_2_and_names_the_ids() -> None:
    result = fedmq("node", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--node-id", "node-999")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--node-id: node ids ['node-999'] are not in this experiment (node-000 .. node-019" in result.stderr


def test_every_subcommand_has_help() -> None:
    for command in ["run", "broker", "coordinator", "node"]:
        result = fedmq(command, "--help")
        assert result.returncode == 0 and "usage: fedmq" in result.stdout and len(result.stdout) > 400


@pytest.mark.parametrize("embedded", [False, True])
async def test_broker_command_serves_until_terminated(embedded: bool) -> None:
    """`fedmq broker` runs mosquitto when installed (or the embedded one) and stops on SIGTERM."""
    if not embedded and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    port = free_port()
    args = ["broker", "--port", str(port)] + (["--embedded"] if embedded else [])
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fedmq", *args, stdout=asyncio.subprocess.PIPE, cwd=ROOT
    )
    try:
        await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 30)
        async with BusClient(BusConfig(port=port), client_id="probe-client", federation="x") as bus:
            assert bus.protocol == ("3.1.1" if embedded else "5")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 15)
    assert ("embedded broker" if embedded else "mosquitto listening") in out.decode()
    assert proc.returncode in (0, 130)


def test_coordinator_resumes_from_its_checkpoint(tmp_path: Path, embedded_broker: str) -> None:
    """A finished 3-round run continued to 5 rounds with --resume starts at round 3 and keeps the record."""
    fed = Federation(tmp_path, embedded_broker, base_config(nodes=2, rounds=3))
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001")
    assert fed.wait() == 0
    first = fed.participation()
    fed.config["rounds"] = 5
    fed.config_path.write_text(yaml.safe_dump(fed.config))
    fed.procs.clear()
    fed.start_coordinator("--resume")
    fed.start_nodes("node-000", "node-001", log="again.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    assert [m["round"] for m in fed.metrics()] == [0, 1, 2, 3, 4]
    assert fed.summary()["rounds_completed"] == 5
    assert {n: r["count"] for n, r in fed.participation().items()} == {n: r["count"] + 2 for n, r in first.items()}
    assert "resumed from the checkpoint of round 2" in fed.log("coordinator.log")


def test_run_grid_reports_the_metrics_and_resumes(tmp_path: Path) -> None:
    """A two-cell grid runs both cells, its report's numbers equal the cells' metrics, a second run
    keeps the finished cells, and `fedmq report` rebuilds the same numbers."""
    exp = base_config(nodes=3, rounds=3) | {"grid": {"seed": [1, 2]}, "report": {"average_over": []}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(exp))
    out = tmp_path / "out"
    result = fedmq("run", str(path), "--out", str(out), "--processes", "1", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "report.json").read_text())
    for cell in json.loads((out / "grid.json").read_text())["cells"]:
        metrics = [json.loads(x) for x in (out / "cells" / cell["id"] / "metrics.jsonl").read_text().splitlines()]
        accuracies = [m["accuracy"] for m in metrics if "accuracy" in m]
        assert len(accuracies) == 3
        column = f"seed={cell['labels']['seed']}"
        assert report["tables"]["best"]["fedavg"][column]["values"] == [max(accuracies)]
        assert report["tables"]["final"]["fedavg"][column]["values"] == [accuracies[-1]]
    assert (out / "report.md").exists() and (out / "curves-seed=1.png").exists()
    again = fedmq("run", str(path), "--out", str(out), "--processes", "1", timeout=300)
    assert again.returncode == 0 and again.stdout.count("finished before, kept") == 2
    (out / "report.json").unlink()
    rebuilt = fedmq("report", str(out))
    assert rebuilt.returncode == 0 and json.loads((out / "report.json").read_text())["tables"] == report["tables"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.root=/nonexistent-fedmq", "fedmq: data error: dataset 'cifar10': not found under the data root"),
        ("model.options.bogus=1", "model 'cnn' has no option 'bogus'"),
        ("partition.min_samples=1000", "partition.min_samples: 20 nodes x 1000 samples needs 20000"),
    ],
)
def test_run_refuses_what_cannot_work_before_starting_anything(tmp_path: Path, override: str, message: str) -> None:
    """Missing data, a bad model option or an impossible partition exit 2 with the reason, no daemon started."""
    extra = ["--set", "data.dataset=cifar10"] if override.startswith("data.") else []
    result = fedmq("run", str(QUICKSTART), "--out", str(tmp_path / "out"), *extra, "--set", override)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_run_stopped_or_killed_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    """SIGTERM stops `fedmq run` cleanly (exit 130); even SIGKILL takes the broker, coordinator and
    nodes with it, so no daemon is orphaned."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedmq", "run", str(QUICKSTART), "--out", str(out), "--set", "rounds=500",
         "--processes", "2", "--quiet"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(600):  # until the first round is written
            if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text():
                break
            time.sleep(0.1)
        children = [
            int(p)
            for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(children) == 4, children  # broker, coordinator, two node hosts
        proc.send_signal(sig)
        code = proc.wait(30)
        assert code == (130 if sig == signal.SIGTERM else -signal.SIGKILL)
        for _ in range(200):
            alive = [p for p in children if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
            if not alive:
                break
            time.sleep(0.1)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
