"""The glibc tuning that keeps chunk buffers for reuse: what it sets, and that it only ever raises."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from broker import allocator


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


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_tune_applies_once_per_process_and_only_raises() -> None:
    # a fresh interpreter: the settings are process-wide, and this test process may have set them already
    code = (
        "from broker import allocator as a\n"
        "assert a.applied() is None\n"
        "assert a.tune(2**20)\n"
        "assert a.applied() == (4 * 2**20, 64 * 2**20), a.applied()\n"
        "assert a.tune(8 * 2**20)\n"
        "assert a.applied() == (16 * 2**20 + 2**16, 64 * 2**20), a.applied()\n"
        "assert a.tune(2**20)\n"
        "assert a.applied() == (16 * 2**20 + 2**16, 64 * 2**20), a.applied()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_bus_client_changes_nothing_process_wide_and_the_entry_point_tunes_as_told() -> None:
    """Importing the bus and building clients leave glibc and paho as they are; `tune_process` at an
    entry point applies both, and `tune_allocator: false` leaves the allocator alone."""
    code = (
        "import paho.mqtt._packet as p\n"
        "original = p.decode_publish\n"
        "from broker import BusClient, BusConfig, allocator, paho_fast\n"
        "from broker.tuning import tune_process\n"
        "BusClient(BusConfig(chunk_bytes=2**16), client_id='a', federation='f')\n"
        "assert allocator.applied() is None and p.decode_publish is original\n"
        "tune_process(BusConfig(chunk_bytes=2**16, tune_allocator=False))\n"
        "assert allocator.applied() is None and paho_fast.installed() is paho_fast.supported()\n"
        "tune_process(BusConfig(chunk_bytes=2**20))\n"
        "assert allocator.applied() == (4 * 2**20, 64 * 2**20), allocator.applied()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_mosquitto_fedmq_starts_gets_the_settings_and_yours_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from broker.mosquitto import find_mosquitto, free_port, start_mosquitto

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
