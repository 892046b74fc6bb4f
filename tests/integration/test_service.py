"""The daemons as services (docs/services.md): readiness, status, watchdog and stopping told to a fake
systemd notify socket (a real unix datagram socket, a path or an abstract one); --connect-timeout
waiting for a broker that comes late; the SIGTERM drain of a node (the update in hand finished, a
task whose model has not come abandoned with its reason, a drain cut short by its bound or a second
SIGTERM) and of the coordinator (its checkpoint, then --resume); the systemd units verified."""

from __future__ import annotations

import asyncio
import configparser
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.broker import BusClient, BusConfig, Kind, Message, Topics
from fedmq.broker.servers.mosquitto import free_port, wait_for_port
from fedmq.experiments.cli import build_parser
from fedmq.fedcore.algorithms.fedavg import Hyperparams, NodeHalf
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.config import NodeConfig
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.workspace import Workspace
from tests.helpers import next_matching, next_message
from tests.integration.daemons import QUICKSTART, ROOT, NotifySocket, fedmq, start, tail, wait_for_line
from tests.integration.federation import Federation, base_config

UNITS = ROOT / "deploy" / "systemd"


def test_the_coordinator_tells_systemd_ready_status_watchdog_and_stopping(tmp_path: Path, embedded_broker: str) -> None:
    """On an abstract socket, with a watchdog of 1 s: a status while it starts, READY=1 once connected
    with the state and round, a ping every half second, and STOPPING=1 on SIGTERM, then exit 0."""
    notify, log = NotifySocket(), tmp_path / "coordinator.log"
    proc = start(
        "coordinator", "--broker", embedded_broker, "--config", str(QUICKSTART), "--out", str(tmp_path / "out"),
        "--federation", f"s{free_port()}", "--set", "policy.wait_for_nodes_s=600", log=log, env=notify.env(1.0),
    )  # fmt: skip
    try:
        ready = notify.wait_for("READY=1", proc, log)
        assert ready == "READY=1\nSTATUS=waiting: round 0/30, 0 nodes live"
        assert any(m.startswith("STATUS=") for m in notify.messages[:-1])  # said something before it was ready
        for _ in range(3):
            assert notify.wait_for("WATCHDOG=1", proc, log) == "WATCHDOG=1"
        proc.send_signal(signal.SIGTERM)
        assert notify.wait_for("STOPPING=1", proc, log).startswith("STOPPING=1\nSTATUS=stopping")
        assert proc.wait(60) == 0, tail(log)
    finally:
        proc.kill()
        notify.close()


def test_a_node_host_is_ready_once_all_its_nodes_are_connected(tmp_path: Path, embedded_broker: str) -> None:
    """READY=1 comes when both nodes are connected and subscribed: their online statuses are on the broker."""
    notify, log = NotifySocket(tmp_path / "notify"), tmp_path / "nodes.log"
    federation = f"s{free_port()}"
    proc = start(
        "node", "--broker", embedded_broker, "--config", str(QUICKSTART), "--federation", federation,
        "--node-id", "node-001", "--node-id", "node-002", log=log, env=notify.env(),
    )  # fmt: skip
    try:
        ready = notify.wait_for("READY=1", proc, log)
        assert ready == "READY=1\nSTATUS=2/2 nodes connected, 0 updates sent"
        states = asyncio.run(_retained(embedded_broker, federation, ["node-001", "node-002"]))
        assert states == {"node-001": "online", "node-002": "online"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, tail(log)
    finally:
        proc.kill()
        notify.close()
    assert asyncio.run(_retained(embedded_broker, federation, ["node-001", "node-002"])) == {
        "node-001": "offline",
        "node-002": "offline",
    }


async def _retained(url: str, federation: str, nodes: list[str]) -> dict[str, str]:
    topics = Topics(federation)
    states: dict[str, str] = {}
    async with BusClient(BusConfig.from_url(url), client_id=f"{federation}-probe", federation=federation) as bus:
        await bus.subscribe(*(topics.node_status(n) for n in nodes))
        while len(states) < len(nodes):
            message = (await next_message(bus)).message
            states[message.sender] = str(message.meta["state"])
    return states


def test_a_daemon_waits_for_a_broker_that_comes_late(tmp_path: Path) -> None:
    """--connect-timeout: the node retries (and says so in its status) until the broker listens, then
    connects and is ready; no restart needed."""
    port = free_port()
    notify, log = NotifySocket(tmp_path / "notify"), tmp_path / "node.log"
    proc = start(
        "node", "--broker", f"mqtt://127.0.0.1:{port}", "--config", str(QUICKSTART), "--node-id", "node-000",
        "--federation", f"s{port}", "--connect-timeout", "300", log=log, env=notify.env(),
    )  # fmt: skip
    broker = None
    try:
        waiting = notify.wait_for("STATUS=waiting for the broker", proc, log)
        assert f"STATUS=waiting for the broker mqtt://127.0.0.1:{port} (Connection refused; attempt 1)" == waiting
        broker = start("broker", "--embedded", "--port", str(port), log=tmp_path / "broker.log")
        wait_for_port("127.0.0.1", port, 30.0, broker)
        notify.wait_for("READY=1", proc, log)
        assert "unreachable (Connection refused); retrying for up to 300 s" in tail(log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, tail(log)
    finally:
        proc.kill()
        notify.close()
        if broker is not None:
            broker.terminate()
            broker.wait(10)


def test_a_daemon_logs_json_lines_with_log_format_json() -> None:
    """Every line on stderr is one JSON object, the retries and the final error line alike."""
    url = f"mqtt://127.0.0.1:{free_port()}"
    result = fedmq(
        "node", "--broker", url, "--config", str(QUICKSTART), "--node-id", "node-000", "--connect-timeout", "1",
        "-v", "--log-format", "json",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines()]
    assert all({"time", "level", "logger", "message", "process"} <= r.keys() for r in records)
    assert records[0]["logger"] == "fedmq.experiments.service" and "retrying for up to 1 s" in records[0]["message"]
    assert records[-1]["level"] == "ERROR" and records[-1]["message"].startswith(f"fedmq: broker error: broker {url}")


@pytest.mark.slow
def test_the_coordinator_drained_by_sigterm_resumes_where_it_stopped(tmp_path: Path, embedded_broker: str) -> None:
    """As its unit runs it: with --resume from the very first start (no checkpoint yet: it starts from
    the beginning). SIGTERM mid-run: exit 0, a summary that says stopped, the checkpoint of the last
    round done; started again with --resume it continues from there to the end, no round twice."""
    fed = Federation(tmp_path, embedded_broker, base_config(nodes=2, rounds=6))
    fed.start_coordinator("--resume")
    fed.start_nodes("node-000", "node-001")
    fed.wait_for_metrics(2)
    assert fed.coordinator is not None
    fed.coordinator.send_signal(signal.SIGTERM)
    assert fed.wait() == 0, fed.log("coordinator.log")  # the nodes (--exit-when-done) see it stop and exit
    assert "no checkpoint in" in fed.log("coordinator.log")
    stopped = fed.summary()
    assert stopped["state"] == "stopped" and 2 <= stopped["rounds_completed"] < 6
    done = stopped["rounds_completed"]
    fed.procs.clear()
    fed.start_coordinator("--resume")
    fed.start_nodes("node-000", "node-001", log="again.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    assert f"resumed from the checkpoint of round {done - 1}" in fed.log("coordinator.log")
    assert [m["round"] for m in fed.metrics()] == [0, 1, 2, 3, 4, 5]
    assert fed.summary()["state"] == "finished" and fed.summary()["rounds_completed"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("how", ["finish", "bound", "second SIGTERM"])
def test_a_node_drained_by_sigterm_finishes_its_update_unless_cut_short(
    how: str, tmp_path: Path, embedded_broker: str
) -> None:
    """node-000 holds its round-0 update (a fault delay) when SIGTERM comes. It finishes and sends it,
    says goodbye and exits 0; with a delay longer than --drain-timeout, or on a second SIGTERM, it
    stops at once with 130 instead."""
    delay = 8 if how == "finish" else 600
    config = base_config(nodes=2, rounds=2, faults={"node-000": {"delay_s": delay, "delay_rounds": [0]}})
    fed = Federation(tmp_path, embedded_broker, config)
    fed.start_coordinator()
    node = fed._start(
        ["node", "--broker", fed.url, "--node-id", "node-000", "--drain-timeout", "1" if how == "bound" else "60"],
        "node-000.log",
    )
    fed.start_nodes("node-001")
    log = tmp_path / "node-000.log"
    try:
        wait_for_line(log, "fault injection: delaying round 0's update", node)
        node.send_signal(signal.SIGTERM)
        if how == "second SIGTERM":
            wait_for_line(log, "SIGTERM: draining", node)
            node.send_signal(signal.SIGTERM)
        code = node.wait(60)
        if how == "finish":
            assert code == 0, tail(log)
            assert "[node-000] draining (SIGTERM): finishing the update in hand" in tail(log)
            assert "[node-000] round 0: trained" in tail(log) and "drained (SIGTERM) after 1 rounds" in tail(log)
            fed.wait_for_metrics(1)
            assert "node-000" in fed.metrics()[0]["accepted"]
        else:
            assert code == 130, tail(log)
            why = "the drain took longer than 1 s" if how == "bound" else "a second SIGTERM during the drain"
            assert f"{why}: stopping at once (exit 130)" in tail(log)
    finally:
        fed.stop()


async def test_a_draining_node_abandons_a_task_whose_model_has_not_come(mosquitto_broker: str) -> None:
    """A scripted coordinator sends a task without its model; the node acknowledges it. Drained, the
    node tells the coordinator it abandons the task and why (an update that says it failed, so the
    round stops waiting for it), says goodbye, and its serve ends."""
    federation = f"t{os.urandom(4).hex()}"
    topics = Topics(federation)
    data = TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0)), torch.arange(16) % 2, 2)
    node = NodeDaemon(
        NodeConfig(node_id="node-000", federation=federation),
        BusConfig.from_url(mosquitto_broker),
        NodeHalf(Hyperparams(), node_id="node-000"),
        data,
        Workspace(build_model("mlp", (3,), 2, seed=0), torch.device("cpu")),
    )
    config = BusConfig.from_url(mosquitto_broker)
    async with BusClient(config, client_id=f"{federation}-coordinator", federation=federation) as coordinator:
        await coordinator.subscribe(topics.node_status("node-000"), topics.update("node-000"), topics.ack("node-000"))
        serving = asyncio.create_task(node.serve())
        await next_matching(coordinator, lambda m: m.kind == Kind.NODE_STATUS and m.meta.get("state") == "online")
        # the announcement goes out from the connect hook, beside the subscription: it may arrive first
        await asyncio.wait_for(node.connected.wait(), 10)
        task_id = os.urandom(16)
        meta: dict[str, Any] = {
            "task": task_id, "attempt": 0, "version": 0, "model_topic": topics.model(0), "deadline_s": 60,
            "settings": TrainSettings(local_epochs=1, batch_size=8).to_meta(),
        }  # fmt: skip
        task = Message(kind=Kind.TASK, federation=federation, round=0, sender="coordinator", meta=meta)
        await coordinator.publish(topics.task("node-000"), task)
        ack = await next_matching(coordinator, lambda m: m.kind == Kind.ACK)
        assert ack.meta["task"] == task_id
        node.drain("a test")
        failure = await next_matching(coordinator, lambda m: m.kind == Kind.UPDATE)
        assert failure.meta == {"task": task_id, "failed": "abandoned: the node is stopping (a test)"}
        await next_matching(coordinator, lambda m: m.kind == Kind.NODE_STATUS and m.meta.get("state") == "offline")
        await asyncio.wait_for(serving, 10)
        assert not node.connected.is_set() and node.rounds_trained == 0


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNITS / name).read_text().replace("\\\n", " "))
    return parser


@pytest.mark.parametrize("name", ["fedmq-coordinator.service", "fedmq-node@.service"])
def test_the_units_are_notify_services_with_a_watchdog_that_restart_on_failure(name: str) -> None:
    service = _unit(name)["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"
    assert service["WatchdogSec"] and service["EnvironmentFile"]
    command = service["ExecStart"].split()
    assert command[0].endswith("/fedmq") and command[1] == ("coordinator" if "coordinator" in name else "node")
    # the flags are fedmq's: the command line parses, with the variables and specifiers filled in
    values = {"${FEDMQ_BROKER}": "mqtt://broker:1883", "${FEDMQ_CONFIG}": "exp.yaml", "%i": "node-003"}
    argv = [values.get(a, a).replace("%S", "/var/lib") for a in command[1:] if not a.startswith("$FEDMQ_")]
    args = build_parser().parse_args(argv)
    assert args.connect_timeout == 300 and args.drain_timeout == 60
    assert float(service["TimeoutStopSec"].removesuffix("s")) > args.drain_timeout
    if "coordinator" in name:
        assert args.resume and str(args.out) == "/var/lib/fedmq/coordinator"
    else:
        assert args.node_ids == ["node-003"]


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """`systemd-analyze verify`, with ExecStart pointing at this checkout's fedmq (verify wants it to
    exist) and the template as an instance; it warns on stderr, so any output is a failure."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (it comes with systemd)")
    fedmq = Path(sys.executable).parent / "fedmq"
    if not fedmq.exists():
        pytest.skip(f"no fedmq executable at {fedmq} (pip install -e .)")
    for unit in UNITS.glob("*.service"):
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/fedmq/venv/bin/fedmq", str(fedmq)))
    (tmp_path / "fedmq-node@node-003.service").symlink_to(tmp_path / "fedmq-node@.service")
    units = [str(tmp_path / "fedmq-coordinator.service"), str(tmp_path / "fedmq-node@node-003.service")]
    result = subprocess.run([analyze, "verify", *units], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stdout + result.stderr
