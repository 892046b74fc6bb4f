"""Issue 30, item 4: the coordinator daemon reads each update before its engine, a large one in a
worker thread. Over a real broker (both), with every update read off the event loop (the threshold
at 0 bytes), a federation folds every update it would fold otherwise, and its event log replays bit
for bit: the digests the ingest step took are the updates' own."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


async def test_updates_read_off_the_event_loop_are_folded_and_the_run_replays(
    tmp_path: Path, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import fedmq.experiments.build
    from fedmq.coordinator.drivers import inbox, mqtt
    from fedmq.experiments.build import build_coordinator, build_nodes
    from fedmq.experiments.config import parse_config
    from fedmq.experiments.replay import replay_run
    from fedmq.fednode.daemon import serve_nodes
    from tests.integration.federation import base_config

    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(inbox, "OFF_LOOP_BYTES", 0)
    threads: list[str] = []
    read = mqtt.ingest

    def recorded(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return read(*args, **kwargs)

    monkeypatch.setattr(mqtt, "ingest", recorded)
    cfg = parse_config(base_config(nodes=2, rounds=3))
    run = tmp_path / "run"
    coordinator = build_coordinator(cfg, broker_url, run, federation=f"it-{os.urandom(4).hex()}")
    nodes = build_nodes(cfg, broker_url, cfg.node_ids(), federation=coordinator.config.federation, exit_when_done=True)
    async with asyncio.timeout(120):
        serving = asyncio.create_task(coordinator.serve())
        hosting = asyncio.create_task(serve_nodes(nodes))
        summary = await serving
        assert await hosting == []
    assert summary.state == "finished" and summary.rounds_completed == 3
    assert len(threads) == 6 and threading.main_thread().name not in threads  # 2 nodes x 3 rounds, off the loop
    assert all(node.count == 3 for node in coordinator.participation)
    (run / "config.yaml").write_text(cfg.to_yaml())
    outcome = replay_run(run, device=torch.device("cpu"))
    assert outcome.ok, outcome.mismatch
