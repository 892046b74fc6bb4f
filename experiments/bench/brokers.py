"""A broker for a benchmark: mosquitto or the embedded one on a free loopback port, or a given URL."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from fedmq.broker import allocator
from fedmq.broker.errors import BusError
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, render_config, wait_for_port
from fedmq.experiments.bench.common import BenchOptions


def broker_kind(options: BenchOptions) -> str:
    """'mosquitto', 'embedded' or 'url', from `options.broker` ('auto': mosquitto when installed)."""
    if options.broker == "auto":
        return "mosquitto" if find_mosquitto() else "embedded"
    if options.broker in ("mosquitto", "embedded"):
        return options.broker
    if options.broker.startswith("mqtt://"):
        return "url"
    raise ValueError(f"--broker {options.broker!r}: use mosquitto, embedded, auto or an mqtt:// URL")


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (a broker, or a host of many node
    connections, needs one descriptor per connection); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@contextlib.contextmanager
def running_broker(options: BenchOptions, *, kind: str | None = None, extra: str = "") -> Iterator[str]:
    """Yield the URL of a broker that lives for the block (a given URL is used as it is); `extra` lines
    go into a mosquitto's config."""
    kind = kind or broker_kind(options)
    if kind == "url":
        yield options.broker
        return
    port = free_port()
    raise_fd_limit()  # inherited by the broker process
    if kind == "mosquitto":
        binary = find_mosquitto()
        if binary is None:
            raise BusError("mosquitto is not installed (apt-get install mosquitto); or use --broker embedded")
        directory = Path(tempfile.mkdtemp(prefix="fedmq-bench-mosquitto-"))
        conf = directory / "mosquitto.conf"
        conf.write_text(render_config(port=port) + "max_connections -1\n" + extra)
        command = [binary, "-c", str(conf)]
    else:
        command = [sys.executable, "-m", "fedmq", "broker", "--embedded", "--port", str(port)]
    env = allocator.child_env(dict(os.environ)) if kind == "mosquitto" else os.environ.copy()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        wait_for_port("127.0.0.1", port, 30.0, proc)
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
