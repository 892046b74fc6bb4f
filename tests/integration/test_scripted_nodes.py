"""Scripted nodes on a real broker: a coordinator and node daemons in this process, each node playing
its scenario script in wall time (offline and back, dropped tasks, modelled slowness).

Each test runs against the embedded broker and against mosquitto.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fedmq.experiments.build
from fedmq.broker import Topics, decode
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.experiments.build import build_coordinator, build_nodes, node_scripts
from fedmq.experiments.config import parse_config
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fednode.daemon import NodeDaemon, serve_nodes
from fedmq.fednode.scenario import NodeScript, Transition
from tests.helpers import raw_client
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


def _build(
    tmp_path: Path, url: str, scripts: dict[str, NodeScript], monkeypatch: pytest.MonkeyPatch, **changes: Any
) -> tuple[Coordinator, list[NodeDaemon]]:
    cfg = parse_config(base_config(nodes=3, **changes))
    federation = f"it-{os.urandom(4).hex()}"
    monkeypatch.setattr(fedmq.experiments.build, "node_scripts", lambda _cfg: scripts)
    monkeypatch.setattr(fedmq.experiments.build, "best_device", lambda: torch.device("cpu"))
    coordinator = build_coordinator(cfg, url, tmp_path / "run", federation=federation)
    nodes = build_nodes(cfg, url, cfg.node_ids(), federation=federation, exit_when_done=True)
    assert [n.config.script for n in nodes] == [scripts.get(n.node_id, NodeScript()) for n in nodes]
    _warm_up(nodes[0])
    return coordinator, nodes


def _warm_up(node: NodeDaemon) -> None:
    """A few training steps of the nodes' model before the scripts' clocks start: a fresh process's
    first backward passes take a second or more, which would otherwise land inside a script's
    timeline (node-002 then crashes before it has finished its first round)."""
    model = copy.deepcopy(node.workspace.model)
    local_sgd(
        model, node.data.subset(np.arange(min(len(node.data), 32))), TrainSettings(batch_size=8), torch.Generator()
    )


async def _run(coordinator: Coordinator, nodes: list[NodeDaemon], timeout: float = 60) -> dict[str, Any]:
    """Run to the end; the coordinator's summary.json."""
    async with asyncio.timeout(timeout):
        await asyncio.gather(coordinator.serve(), serve_nodes(nodes))
    summary: dict[str, Any] = json.loads((coordinator.config.out_dir / "summary.json").read_text())
    return summary


async def test_scripted_availability_goes_offline_and_back_on_the_bus(
    tmp_path: Path, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node-001 starts offline and comes online at 0.8 s; node-002 crashes at 1.5 s and is back at
    2.5 s. A raw subscriber sees node-002's retained status go offline and online again (the
    connection stays up); the coordinator runs rounds without each while it is away (node-002 lost
    from the round it was in, if any) and with it after."""
    base = {"task_s": 0.15}
    scripts = {
        "node-000": NodeScript(**base),
        "node-001": NodeScript(starts_online=False, transitions=(Transition(0.8, True),), **base),
        "node-002": NodeScript(transitions=(Transition(1.5, False, crash=True), Transition(2.5, True)), task_s=0.3),
    }
    coordinator, nodes = _build(tmp_path, broker_url, scripts, monkeypatch, rounds=14, policy={"min_nodes": 2})
    topic = Topics(coordinator.config.federation).node_status("node-002")
    seen: list[tuple[str, float]] = []

    async def watch() -> None:
        async with raw_client(broker_url) as raw:
            await raw.subscribe(topic, qos=1)
            ready.set()
            async for message in raw.messages:
                seen.append((decode(bytes(message.payload)).meta["state"], time.monotonic()))  # type: ignore[arg-type]

    ready = asyncio.Event()
    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(ready.wait(), 10)
    summary = await _run(coordinator, nodes)
    await asyncio.sleep(0.3)  # the goodbye
    watcher.cancel()

    assert summary["state"] == "finished" and summary["rounds_completed"] == 14
    # a repeated state is the node announcing itself again to the coordinator's new run (issue 31)
    changes = [(state, at) for i, (state, at) in enumerate(seen) if i == 0 or seen[i - 1][0] != state]
    states = [state for state, _ in changes]
    assert states == ["online", "offline", "online", "offline"], seen  # connect, crash, back, goodbye
    assert 0.7 < changes[2][1] - changes[1][1] < 2.0, seen
    lines = _metrics(tmp_path)
    away = [line["round"] for line in lines if "node-002" not in line["accepted"]]
    assert away and away == list(range(away[0], away[-1] + 1)) and away[0] > 0 and away[-1] < 13, lines
    for line in lines[away[0] : away[-1] + 1]:  # offline: not selected, or lost from the round it was in
        assert "node-002" not in line["selected"] or line["lost"] == ["node-002"], line
        assert line["late"] == [], line
    assert lines[away[0] + 1]["live"] == 2, lines
    record = coordinator.participation.to_json()
    assert record["node-002"]["lost"] == sum("node-002" in line["lost"] for line in lines) <= 1
    assert nodes[2].player.counts()["abandoned"] <= 1
    assert "node-001" not in lines[0]["selected"] and "node-001" in lines[-1]["accepted"]
    assert summary["bus"]["rejected"] == {}


async def test_dropping_and_slow_nodes_miss_the_deadline(
    tmp_path: Path, broker_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """node-001 drops every task (drop_p = 1): every round closes at its 1 s deadline without it and
    it never answers. node-002 computes for a modelled 1.6 s: it misses each deadline and its update
    arrives late, during the next round. Both stay online, so the coordinator records them late
    (missing at the deadline), not lost (which is for nodes that left)."""
    scripts = {"node-001": NodeScript(drop_p=1.0), "node-002": NodeScript(task_s=1.6)}
    coordinator, nodes = _build(tmp_path, broker_url, scripts, monkeypatch, rounds=3, deadline_s=1.0)
    summary = await _run(coordinator, nodes)

    assert summary["state"] == "finished" and summary["rounds_completed"] == 3
    lines = _metrics(tmp_path)
    for line in lines:  # round 0 may be retried: a process's first training can take a second
        assert {"node-001", "node-002"} <= set(line["late"]) and "node-000" not in line["lost"], line
        assert 0.9 < line["round_seconds"] < 3, line
    assert lines[-1]["accepted"] == lines[-2]["accepted"] == ["node-000"], lines
    tasks = len(lines)  # one per round attempt
    assert nodes[1].player.counts() == {"tasks": tasks, "dropped": tasks, "ignored_offline": 0, "abandoned": 0}
    assert nodes[1].rounds_trained == 0 and nodes[2].rounds_trained >= 1
    assert summary["late_arrivals"] >= 1  # node-002's round-0 update, during round 1 (its last may come after the end)
    record = coordinator.participation.to_json()
    assert record["node-001"]["count"] == record["node-002"]["count"] == 0


def test_experiment_scenario_drives_the_node_processes(tmp_path: Path, broker_url: str) -> None:
    """End to end from the experiment file, coordinator and nodes in their own processes: the
    scenario's node-001 drops every task and node-002 crashes at 1.5 s for 2 s; node-000 answers
    the last rounds, node-001 none, node-002 misses a round or more while away and is back at the end
    (a process's first training may take a second: round 0 can miss its deadline and be retried)."""
    scenario = {
        "compute": {"task_s": 0.1},
        "groups": [
            {"nodes": ["node-001"], "drop_p": 1.0},
            {"nodes": ["node-002"], "crashes": [{"at": 1.5, "reconnect_after": 2.0}]},
        ],
    }
    cfg = base_config(nodes=3, rounds=6, deadline_s=1.0, scenario=scenario)
    scripts = node_scripts(parse_config(cfg))
    assert scripts["node-000"].compute_s(100) == 0.1 and scripts["node-001"].drop_p == 1.0
    assert [(t.at, t.online, t.crash) for t in scripts["node-002"].transitions] == [
        (1.5, False, True),
        (3.5, True, False),
    ]
    assert node_scripts(parse_config(base_config())) == {}
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, summary = fed.metrics(), fed.summary()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 6
    assert all("node-001" in line["late"] and "node-001" not in line["accepted"] for line in metrics), metrics
    assert any("node-002" not in line["selected"] or "node-002" in line["lost"] for line in metrics), metrics
    assert metrics[-1]["accepted"] == ["node-000", "node-002"], metrics
    log = fed.log("node-000.log")
    assert "[node-001] scenario: dropping task 0" in log and "[node-002] scenario: crashes at 1.5 s" in log, log


def _metrics(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
