"""The glibc tuning that keeps chunk buffers for reuse: what it sets, and that it only ever raises."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from fedmq.broker import allocator


def test_child_env_sets_both_thresholds_and_keeps_what_the_user_set() -> None:
    env = allocator.child_env({"PATH": "/bin"}, chunk_bytes=2**20)
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(4 * 2**20) and env["MALLOC_TRIM_THRESHOLD_"] == str(64 * 2**20)
    assert env["MALLOC_TOP_PAD_"] == str(64 * 2**20)
    assert env["PATH"] == "/bin"
    mine = allocator.child_env({"MALLOC_TRIM_THRESHOLD_": "1"}, chunk_bytes=8 * 2**20)
    assert mine["MALLOC_TRIM_THRESHOLD_"] == "1"
    assert mine["MALLOC_MMAP_THRESHOLD_"] == str(16 * 2**20 + 2**16)  # two 8 MiB chunks fit under it
    capped = allocator.child_env({}, chunk_bytes=60 * 2**20)
    assert capped["MALLOC_MMAP_THRESHOLD_"] == str(allocator.MMAP_THRESHOLD_MAX)


GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def _in_a_fresh_interpreter(*lines: str) -> None:
    """Run `lines` in a new Python: the settings are process-wide, and this test process has set them."""
    done = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@GLIBC
def test_tune_applies_once_per_process_and_only_raises() -> None:
    _in_a_fresh_interpreter(
        "from fedmq.broker import allocator as a",
        "assert a.applied() is None",
        "assert a.tune(2**20)",
        "assert a.applied() == (4 * 2**20, 64 * 2**20), a.applied()",
        "assert a.tune(8 * 2**20)",
        "assert a.applied() == (16 * 2**20 + 2**16, 64 * 2**20), a.applied()",
        "assert a.tune(2**20)",
        "assert a.applied() == (16 * 2**20 + 2**16, 64 * 2**20), a.applied()",
    )


@GLIBC
def test_a_bus_client_changes_nothing_process_wide_and_the_entry_point_tunes_as_told() -> None:
    """Importing the bus and building clients leave glibc and paho as they are; `tune_process` at an
    entry point applies both, and `tune_allocator: false` leaves the allocator alone."""
    _in_a_fresh_interpreter(
        "import paho.mqtt._packet as p",
        "original = p.decode_publish",
        "from fedmq.broker import BusClient, BusConfig, allocator, paho_fast",
        "from fedmq.broker.tuning import tune_process",
        "BusClient(BusConfig(chunk_bytes=2**16), client_id='a', federation='f')",
        "assert allocator.applied() is None and p.decode_publish is original",
        "tune_process(BusConfig(chunk_bytes=2**16, tune_allocator=False))",
        "assert allocator.applied() is None and paho_fast.installed() is paho_fast.supported()",
        "tune_process(BusConfig(chunk_bytes=2**20))",
        "assert allocator.applied() == (4 * 2**20, 64 * 2**20), allocator.applied()",
    )


def test_the_mosquitto_fedmq_starts_gets_the_settings_and_yours_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, start_mosquitto

    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    proc = start_mosquitto(free_port())
    try:
        raw = Path(f"/proc/{proc.pid}/environ").read_text().split("\0")
        environ = dict(item.split("=", 1) for item in raw if "=" in item)
    finally:
        proc.terminate()
        proc.wait(10)
    assert environ["MALLOC_MMAP_THRESHOLD_"] == str(4 * 2**20) and environ["MALLOC_TOP_PAD_"] == str(64 * 2**20)
    assert environ["MALLOC_TRIM_THRESHOLD_"] == "12345"
