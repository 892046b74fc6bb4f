"""`fedmq` daemons as subprocesses for the service tests, and a stand-in for systemd's notify socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def fedmq(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=os.environ | (env or {}),
    )  # fmt: skip


def start(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`fedmq ARGS` in the background, its output (stdout and stderr) in `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fedmq", *args],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
            env=os.environ | {"PYTHONUNBUFFERED": "1"} | (env or {}),
        )  # fmt: skip


def wait_for_line(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until `text` appears in `log` (the daemon logs it); fails early when the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {log.name} (exit code {proc.poll()}):\n{tail(log)}")


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"


class NotifySocket:
    """A unix datagram socket bound where $NOTIFY_SOCKET points, as systemd's: what the daemon says."""

    def __init__(self, path: Path | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if path is None:  # the abstract namespace: '@name' in the variable, a leading NUL in the address
            name = f"fedmq-test-{os.urandom(6).hex()}"
            self.sock.bind("\0" + name)
            self.address = "@" + name
        else:
            self.sock.bind(str(path))
            self.address = str(path)
        self.sock.settimeout(0.2)
        self.messages: list[str] = []

    def env(self, watchdog_s: float | None = None) -> dict[str, str]:
        extra = {"WATCHDOG_USEC": str(int(watchdog_s * 1e6))} if watchdog_s else {}
        return {"NOTIFY_SOCKET": self.address, **extra}

    def wait_for(self, field: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 90) -> str:
        """The first message (from the next one on) with a line starting with `field`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.sock.recv(65536).decode()
            except TimeoutError:
                if proc.poll() is not None:
                    break
                continue
            self.messages.append(message)
            if any(line.startswith(field) for line in message.splitlines()):
                return message
        raise AssertionError(f"no {field} (exit code {proc.poll()}); got {self.messages[-5:]}:\n{tail(log)}")

    def close(self) -> None:
        self.sock.close()
