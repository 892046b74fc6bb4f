"""The daemons' event loop: uvloop by default where installed, asyncio's on request, a clear error else."""

from __future__ import annotations

import asyncio

import pytest

from fedmq.experiments.cli.loop import event_loop_factory, run_async
from fedmq.fedcore.errors import ConfigError


async def _loop_module() -> int:
    return 1 if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else 0


def test_uvloop_by_default_and_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv("FEDMQ_EVENT_LOOP", raising=False)
    assert event_loop_factory() is uvloop.new_event_loop
    assert run_async(_loop_module()) == 1
    monkeypatch.setenv("FEDMQ_EVENT_LOOP", "asyncio")
    assert event_loop_factory() is None
    assert run_async(_loop_module()) == 0


def test_an_unknown_event_loop_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDMQ_EVENT_LOOP", "trio")
    with pytest.raises(ConfigError, match="use 'uvloop' or 'asyncio'"):
        event_loop_factory()
