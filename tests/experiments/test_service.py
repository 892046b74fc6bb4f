"""experiments.service and experiments.logs in process: sd_notify on real unix datagram sockets (a
path and the abstract namespace), the watchdog and readiness loop, waiting for a broker with
backoff and jitter (a real closed port, then a real listener), and the JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq.broker import BusConfig
from fedmq.broker.errors import BusError
from fedmq.broker.servers.mosquitto import free_port
from fedmq.experiments import logs
from fedmq.experiments.service import Notifier, wait_for_broker
from fedmq.fedcore.errors import ConfigError

pytestmark = pytest.mark.timed  # waits on sockets and the service notifier: never in the compute lane (conftest)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A unix datagram socket standing in for systemd's, and its $NOTIFY_SOCKET value."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(10)
    yield sock, str(path)
    sock.close()


def _recv(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_without_notify_socket_nothing_is_sent_and_nothing_fails() -> None:
    environ: dict[str, str] = {"WATCHDOG_USEC": "1000000"}
    notifier = Notifier(environ)
    assert not notifier.enabled and notifier.watchdog_s is None
    assert notifier.send("READY=1") is False
    assert environ == {}  # removed anyway: a child process must not ping for this one


def test_notifications_reach_a_path_socket_and_the_variables_are_removed(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    environ = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid()), "HOME": "/x"}
    notifier = Notifier(environ)
    assert notifier.enabled and notifier.watchdog_s == 3.0
    assert environ == {"HOME": "/x"}
    assert notifier.send("READY=1", "STATUS=up")
    assert _recv(sock) == "READY=1\nSTATUS=up"
    notifier.status("round 1\nof 3")  # one line: a newline would start another field
    notifier.status("round 1 of 3")  # unchanged: not sent again
    notifier.stopping("SIGTERM")
    assert [_recv(sock), _recv(sock)] == ["STATUS=round 1 of 3", "STOPPING=1\nSTATUS=stopping: SIGTERM"]


def test_an_abstract_notify_socket_is_reached() -> None:
    name = f"fedmq-test-{os.urandom(6).hex()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(10)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send("READY=1")
        assert _recv(sock) == "READY=1"


def test_a_watchdog_meant_for_another_process_is_not_pinged(receiver: tuple[socket.socket, str]) -> None:
    _, path = receiver
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)})
    assert other.enabled and other.watchdog_s is None
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "soon"}).watchdog_s is None
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled


def test_a_vanished_socket_is_reported_once_and_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.send("WATCHDOG=1") is False and notifier.send("WATCHDOG=1") is False
    assert len([r for r in caplog.records if "cannot notify" in r.getMessage()]) == 1


async def test_ready_waits_for_every_event_and_the_watchdog_pings_meanwhile(
    receiver: tuple[socket.socket, str],
) -> None:
    sock, path = receiver
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})  # pings every 0.05 s
    first, second = asyncio.Event(), asyncio.Event()
    state = {"text": "starting"}

    async def until(predicate: str) -> list[str]:
        seen = []
        async with asyncio.timeout(10):
            while not seen or predicate not in seen[-1]:
                seen.append((await loop.sock_recv(sock, 4096)).decode())
        return seen

    async with notifier.running([first, second], lambda: state["text"]):
        before = await until("WATCHDOG=1") + await until("WATCHDOG=1")
        first.set()
        before += await until("WATCHDOG=1") + await until("WATCHDOG=1")
        assert not any("READY=1" in m for m in before)  # one of two connected is not ready
        assert "STATUS=starting" in before
        state["text"] = "running: round 0/3"
        second.set()
        ready = await until("READY=1")
        assert ready[-1] == "READY=1\nSTATUS=running: round 0/3"
        state["text"] = "running: round 1/3"
        assert "STATUS=running: round 1/3" in await until("STATUS=running: round 1/3")
        assert "WATCHDOG=1" in await until("WATCHDOG=1")  # still pinging once ready
    assert (await until("STOPPING=1"))[-1] == "STOPPING=1\nSTATUS=stopping: running: round 1/3"


async def test_the_broker_wait_fails_at_once_with_0_and_names_the_broker() -> None:
    config = BusConfig(port=free_port())
    with pytest.raises(BusError) as caught:
        await wait_for_broker(config, 0)
    text = str(caught.value)
    assert f"broker mqtt://127.0.0.1:{config.port} unreachable at the first attempt" in text
    assert "refused" in text.lower() and "--connect-timeout SECONDS" in text


async def test_the_broker_wait_backs_off_exponentially_with_jitter_up_to_the_cap() -> None:
    """A fake clock that the waits advance: each pause lies between half and all of the doubling delay
    (0.25 s, capped at 2 s here), the last one shortened to the time left, and the error says how many tries."""
    now = [0.0]
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)
        now[0] += seconds

    config = BusConfig(port=free_port())
    with pytest.raises(BusError, match=r"unreachable within 12 s \((\d+) attempts\)") as caught:
        await wait_for_broker(config, 12, max_s=2.0, clock=lambda: now[0], sleep=sleep, rng=random.Random(3))
    delays = [min(0.25 * 2**i, 2.0) for i in range(len(pauses))]
    assert all(d / 2 <= p <= d for p, d in zip(pauses[:-1], delays, strict=False))
    assert pauses[-1] <= delays[-1] and sum(pauses) == pytest.approx(12)
    assert len(set(pauses[:-1])) == len(pauses) - 1  # jittered: no two waits alike
    assert f"({len(pauses) + 1} attempts)" in str(caught.value)


async def test_the_broker_wait_returns_once_the_broker_listens() -> None:
    """The first refusal starts a listener on the port: a later try connects and the wait returns."""
    port = free_port()
    refused = asyncio.Event()
    tries: list[int] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    def on_retry(attempt: int, why: str) -> None:
        tries.append(attempt)
        refused.set()

    async def listen_once_refused() -> asyncio.Server:
        await refused.wait()
        return await asyncio.start_server(hang_up, "127.0.0.1", port)

    listener = asyncio.create_task(listen_once_refused())
    await wait_for_broker(BusConfig(port=port), 60, initial_s=0.05, on_retry=on_retry)
    server = await listener
    server.close()
    await server.wait_closed()
    assert tries[0] == 1


def test_json_log_lines_carry_the_fields_and_the_traceback() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    log = logging.getLogger("fednode.daemon.test-json")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("round %d: %s", 3, "late", extra={"node_id": "node-007"})
        try:
            raise ValueError("a bad\nmessage")
        except ValueError:
            log.exception("training failed")
    finally:
        log.removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # one object a line, the traceback's newlines escaped
    first, second = (json.loads(x) for x in lines)
    assert first["message"] == "round 3: late" and first["level"] == "WARNING" and first["node_id"] == "node-007"
    assert first["logger"] == "fednode.daemon.test-json" and first["process"] == os.getpid()
    assert first["time"].endswith("+00:00") and "exception" not in first
    assert second["level"] == "ERROR" and second["message"] == "training failed"
    assert second["exception"].startswith("Traceback") and "ValueError: a bad\nmessage" in second["exception"]


def test_the_command_line_error_line_is_json_in_json_mode() -> None:
    assert logs.line("fedmq: broken", "text") == "fedmq: broken"
    parsed = json.loads(logs.line("fedmq: broken", "json"))
    assert parsed["message"] == "fedmq: broken" and parsed["level"] == "ERROR" and parsed["logger"] == "fedmq"


def test_logging_mistakes_are_configuration_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("version: 1\nhandlers: {x: {class: no.such.Handler}}\n")
    with pytest.raises(ConfigError, match=r"--log-config .*bad\.yaml: Unable to configure handler 'x'"):
        logs.setup(config_file=tmp_path / "bad.yaml")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot open"):
        logs.setup(file=tmp_path / "file" / "below-a-file.log")
    with pytest.raises(ConfigError, match="log format 'xml'"):
        logs.setup(fmt="xml")
