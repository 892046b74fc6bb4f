"""`fedmq.malloc`: glibc's settings for the process only ever change toward keeping more, so that the bus's
chunk buffers (`broker.allocator`) and the training's tensors (`fedcore.host_memory`), asked in either order
in one node process, each keep what they asked. Each case runs in a fresh Python: the settings are the
process's, and this test process has set some."""

from __future__ import annotations

import platform

import pytest

from tests.interpreter import fresh_python

GLIBC = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")


def _in_a_fresh_interpreter(*lines: str) -> None:
    fresh_python("\n".join(["from fedmq import malloc as m", *lines]))


@GLIBC
def test_a_setting_only_changes_toward_keeping_more() -> None:
    _in_a_fresh_interpreter(
        "assert m.settings() == {}",
        "assert m.keep({m.M_TRIM_THRESHOLD: 2**20, m.M_MMAP_MAX: 10})",
        "assert m.keep({m.M_TRIM_THRESHOLD: 2**10, m.M_MMAP_MAX: 100})",  # keeps less: left as it was, still held
        "assert m.settings() == {m.M_TRIM_THRESHOLD: 2**20, m.M_MMAP_MAX: 10}, m.settings()",
        "assert m.keep({m.M_TRIM_THRESHOLD: 2**30, m.M_MMAP_MAX: 0})",
        "assert m.settings() == {m.M_TRIM_THRESHOLD: 2**30, m.M_MMAP_MAX: 0}, m.settings()",
    )


@GLIBC
@pytest.mark.parametrize("bus_first", [True, False], ids=["bus-first", "training-first"])
def test_the_bus_and_the_training_keep_what_each_asked_in_either_order(bus_first: bool) -> None:
    bus = "assert allocator.tune(2**20) and allocator.applied() == (4 * 2**20, 64 * 2**20)"
    training = "assert set_host_memory('keep')"
    _in_a_fresh_interpreter(
        "from fedmq.broker import allocator",
        "from fedmq.fedcore.host_memory import INT_MAX, set_host_memory",
        *([bus, training] if bus_first else [training, bus]),
        "got = m.settings()",
        "assert got[m.M_MMAP_MAX] == 0 and got[m.M_TRIM_THRESHOLD] == INT_MAX, got",  # the training's
        "assert got[m.M_MMAP_THRESHOLD] == 4 * 2**20 and got[m.M_TOP_PAD] == 64 * 2**20, got",  # the bus's
    )


def test_an_unknown_library_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedmq import malloc

    monkeypatch.setattr(malloc, "_mallopt", lambda: None)
    assert malloc.keep({malloc.M_MMAP_MAX: 0}) is False
