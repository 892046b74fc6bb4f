"""Every exit code the README promises ("0 done, 2 invalid configuration or missing data, 3 broker
unreachable, 4 the federation failed, 5 a replay differs from its recorded run, 130 interrupted"),
for the commands where it arises, as a user or a supervisor sees it: `fedmq` as a subprocess, a real
broker over TCP, a one-line message and never a traceback for a user's mistake.

Codes already checked elsewhere, not repeated here:
  0    fedmq run to the end: test_cli.py::test_run_quickstart_writes_the_run_directory; coordinator and
       nodes to the end: test_cli.py::test_coordinator_resumes_from_its_checkpoint; a replay that matches
       and 5 for one that differs: tests/experiments/test_replay.py::test_the_command_exits_0_on_a_match_and_5_with_a_message_on_a_difference
  2    fedmq run with an invalid config: test_cli.py::test_run_with_an_invalid_config_exits_2_and_names_the_field;
       missing data, a bad model option, an impossible partition: test_cli.py::test_run_refuses_what_cannot_work_before_starting_anything;
       an unknown --node-id: test_cli.py::test_node_with_an_unknown_id_exits_2_and_names_the_ids; replay of a
       directory that is no run: test_replay.py::test_replay_of_a_directory_that_is_not_a_run_says_so;
       fedmq bench with an unknown suite: test_bench.py; provision mistakes: test_secure_cli.py
  3    fedmq coordinator and fedmq node with no broker: test_cli.py::test_coordinator_without_a_broker_exits_3_with_advice,
       test_cli.py::test_node_without_a_broker_exits_3_so_a_supervisor_restarts_it
  130  fedmq run stopped by SIGTERM: test_cli.py::test_run_stopped_or_killed_leaves_no_process_behind
The daemons' drain on SIGTERM in a running federation (0, and 130 when it is cut short) and the
coordinator's --resume after it: test_service.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from fedmq.broker import BusClient, BusConfig, Kind, Topics
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port
from tests.helpers import next_message
from tests.integration.daemons import QUICKSTART, NotifySocket, fedmq, start, tail

WAITING = ["--set", "policy.wait_for_nodes_s=600"]
"""A coordinator that waits for nodes that never come (it does nothing else meanwhile)."""


def _one_clear_line(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert stderr.startswith("fedmq"), stderr


@pytest.mark.parametrize(
    "command",
    [
        ["coordinator", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART)],
        ["node", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--node-id", "node-000"],
        ["simulate", str(QUICKSTART)],
        ["provision", "OUT", "--config", str(QUICKSTART)],
    ],
    ids=lambda c: c[0],
)
def test_an_invalid_config_exits_2_naming_the_field(command: list[str], tmp_path: Path) -> None:
    """Checked before anything connects: the broker here is unreachable, yet the answer is 2, not 3."""
    args = [str(tmp_path / "out") if a == "OUT" else a for a in command]
    if command[0] in ("coordinator", "simulate"):
        args += ["--out", str(tmp_path / "out")]
    result = fedmq(*args, "--set", "policy.fraction=2.5")
    assert result.returncode == 2, result.stderr
    _one_clear_line(result.stderr)
    assert "policy.fraction: Input should be less than or equal to 1 (got 2.5)" in result.stderr


@pytest.mark.parametrize("command", ["coordinator", "node"])
def test_missing_data_exits_2_for_the_daemons(command: str, tmp_path: Path) -> None:
    args = ["--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART)]
    args += ["--out", str(tmp_path / "out")] if command == "coordinator" else ["--node-id", "node-000"]
    result = fedmq(command, *args, "--set", "data.dataset=cifar10", "--set", "data.root=/nonexistent-fedmq")
    assert result.returncode == 2, result.stderr
    _one_clear_line(result.stderr)
    assert "fedmq: data error: dataset 'cifar10': not found under the data root" in result.stderr


def test_mistakes_in_logging_and_output_paths_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    bad_logging = tmp_path / "logging.yaml"
    bad_logging.write_text("version: 1\nhandlers: {x: {class: no.such.Handler}}\n")
    cases = [
        (["methods", "--log-file", str(a_file / "x.log")], f"cannot open {a_file}"),
        (["methods", "--log-config", str(bad_logging)], "Unable to configure handler 'x'"),
        (["methods", "--log-config", str(tmp_path / "missing.yaml")], "No such file or directory"),
        (
            ["coordinator", "--broker", "mqtt://127.0.0.1:1", "--config", str(QUICKSTART), "--out", str(a_file / "o")],
            f"fedmq: {a_file / 'o'}: ",
        ),
    ]
    for args, message in cases:
        result = fedmq(*args)
        assert result.returncode == 2, (args, result.stderr)
        _one_clear_line(result.stderr)
        assert message in result.stderr, (args, result.stderr)


def test_run_with_an_unreachable_broker_exits_3_before_starting_anything(tmp_path: Path) -> None:
    out = tmp_path / "out"
    url = f"mqtt://127.0.0.1:{free_port()}"
    result = fedmq("run", str(QUICKSTART), "--broker", url, "--out", str(out), "--set", "rounds=2", "--quiet")
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"fedmq: broker error: broker {url} unreachable within 10 s" in result.stderr
    assert "Traceback" not in result.stderr and not (out / "logs").exists()


def test_the_daemons_wait_for_no_broker_with_connect_timeout_0(tmp_path: Path) -> None:
    url = f"mqtt://127.0.0.1:{free_port()}"
    result = fedmq(
        "coordinator", "--broker", url, "--config", str(QUICKSTART), "--out", str(tmp_path / "o"),
        "--connect-timeout", "0",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert f"broker {url} unreachable at the first attempt: Connection refused" in result.stderr


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "mosquitto"])
def test_a_broker_that_cannot_listen_exits_3_saying_where(embedded: bool) -> None:
    if not embedded and find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = fedmq("broker", "--port", str(port), *(["--embedded"] if embedded else []))
    assert result.returncode == 3, result.stdout + result.stderr
    assert f"fedmq: broker error: cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_federation_that_fails_exits_4(tmp_path: Path, embedded_broker: str) -> None:
    """No node comes within wait_for_nodes_s: the run fails, says why in its summary, and exits 4."""
    out = tmp_path / "out"
    result = fedmq(
        "coordinator", "--broker", embedded_broker, "--config", str(QUICKSTART), "--out", str(out),
        "--federation", f"x{free_port()}", "--set", "policy.wait_for_nodes_s=1",
    )  # fmt: skip
    assert result.returncode == 4, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "failed" and summary["rounds_completed"] == 0
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_the_coordinator_interrupted_exits_130_and_drained_exits_0(
    sig: signal.Signals, code: int, tmp_path: Path, embedded_broker: str
) -> None:
    """Once it is ready (READY=1 on its notify socket): Ctrl-C is 130; SIGTERM stops it cleanly, with
    its summary written, and is 0, which no supervisor takes for a failure."""
    notify, log, out = NotifySocket(tmp_path / "notify"), tmp_path / "coordinator.log", tmp_path / "out"
    proc = start(
        "coordinator", "--broker", embedded_broker, "--config", str(QUICKSTART), "--out", str(out),
        "--federation", f"x{free_port()}", *WAITING, log=log, env=notify.env(),
    )  # fmt: skip
    assert signalled_when_ready(proc, notify, log, sig) == code, tail(log)
    assert json.loads((out / "summary.json").read_text())["state"] == "stopped"
    assert "Traceback" not in tail(log)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["SIGINT", "SIGTERM"])
def test_the_node_interrupted_exits_130_and_drained_exits_0_saying_goodbye(
    sig: signal.Signals, code: int, tmp_path: Path, embedded_broker: str
) -> None:
    notify, log = NotifySocket(tmp_path / "notify"), tmp_path / "node.log"
    federation = f"x{free_port()}"
    proc = start(
        "node", "--broker", embedded_broker, "--config", str(QUICKSTART), "--node-id", "node-003",
        "--federation", federation, "-v", log=log, env=notify.env(),
    )  # fmt: skip
    assert signalled_when_ready(proc, notify, log, sig) == code, tail(log)
    assert asyncio.run(_retained_state(embedded_broker, federation, "node-003")) == "offline"
    if sig == signal.SIGTERM:
        assert "[node-003] drained (SIGTERM) after 0 rounds trained" in tail(log)


def signalled_when_ready(proc: subprocess.Popen[bytes], notify: NotifySocket, log: Path, sig: signal.Signals) -> int:
    """Send `sig` once the daemon said READY=1 on its notify socket; its exit code."""
    try:
        notify.wait_for("READY=1", proc, log)
        proc.send_signal(sig)
        return proc.wait(60)
    finally:
        proc.kill()
        notify.close()


async def _retained_state(url: str, federation: str, node: str) -> str:
    topics = Topics(federation)
    async with BusClient(BusConfig.from_url(url), client_id=f"{federation}-probe", federation=federation) as bus:
        await bus.subscribe(topics.node_status(node))
        message = (await next_message(bus)).message
    assert message.kind == Kind.NODE_STATUS
    return str(message.meta["state"])
