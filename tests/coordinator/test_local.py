"""The in-process driver (`coordinator.drivers.local.LocalFederation`) on a tiny FedAvg federation:
asynchronous runs with heterogeneous virtual compute times, a sync deadline, a node going offline."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch

from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import make_engine
from fedmq.coordinator.engine.commands import TaskSpec
from fedmq.coordinator.halfcalls import HalfCalls
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.tensors import model_sha256
from tests.algorithms.common import SETTINGS, context, same_state, scalar_model, shards, tiny_model
from tests.algorithms.common import update as node_update
from tests.coordinator.engine_helpers import config

NODES = ("node-000", "node-001", "node-002")
SPEEDS = {"node-000": 1.0, "node-001": 2.0, "node-002": 5.0}
"""Virtual seconds a task takes on each node: node-000 is five times as fast as node-002."""
AGGREGATIONS = 17


def federation(cfg: CoordinatorConfig, compute: dict[str, float]) -> LocalFederation:
    """FedAvg over the three label-skewed shards, each node taking `compute[node]` virtual seconds a task."""
    spec = get_algorithm("fedavg")
    hp = build_hyperparams(spec, {})
    half = spec.coordinator(hp, model=tiny_model(0))
    nodes = {n: LocalNode(spec.node(hp, node_id=n), data) for n, data in zip(NODES, shards(), strict=True)}
    return LocalFederation(
        engine=make_engine(dataclasses.replace(cfg, train=SETTINGS), half.update_schema(), evaluates=False),
        half=half,
        nodes=nodes,
        workspace=tiny_model(99),
        compute_s=lambda node, task: compute[node],
    )


def fedasync() -> LocalFederation:
    cfg = config(engine="async", buffer=1, concurrency=3, aggregations=AGGREGATIONS, max_staleness=50)
    return federation(cfg, SPEEDS)


def test_async_run_with_heterogeneous_speeds_finishes_with_every_aggregation() -> None:
    """FedAsync (K = 1, every node busy) on nodes of 1, 2 and 5 s a task produces all 17 versions and stops."""
    fed = fedasync()
    records = fed.run()
    assert fed.engine.state == "finished" and fed.engine.version == AGGREGATIONS
    assert [r["model_version"] for r in records] == list(range(1, AGGREGATIONS + 1))
    assert all(len(r["folded"]) == 1 for r in records)


def test_async_run_is_deterministic() -> None:
    """Two runs of the same federation give the same metrics lines, participation record and model, bit for bit."""
    a, b = fedasync(), fedasync()
    assert a.run() == b.run()
    assert a.engine.participation.to_json() == b.engine.participation.to_json()
    assert same_state(a.model(), b.model())


def test_async_fast_nodes_deliver_more_and_the_clock_ends_where_the_speeds_put_it() -> None:
    """Fast nodes deliver more (10, 5, 2 updates) and the virtual clock ends at t = 10, as the speeds imply."""
    # Each node restarts the moment it delivers, so node n delivers at c_n, 2 c_n, ...: the run ends at the
    # 17th smallest of those times (t = 10: 1..10, 2..10 by 2, 5 and 10 give 10 + 5 + 2 = 17), and by then
    # each node has delivered floor(10 / c_n) updates.
    fed = fedasync()
    records = fed.run()
    arrivals = sorted(k * c for c in SPEEDS.values() for k in range(1, AGGREGATIONS + 1))
    end = arrivals[AGGREGATIONS - 1]
    assert end == 10.0 and fed.clock.now() == pytest.approx(end)
    folded = Counter(n for r in records for n in r["folded"])
    assert folded == {n: math.floor(end / c) for n, c in SPEEDS.items()}
    assert folded["node-000"] > folded["node-001"] > folded["node-002"]
    assert {p.node_id: p.count for p in fed.engine.participation} == dict(folded)


def test_async_slow_nodes_updates_are_stale() -> None:
    """Every update of the slowest node is stale (its first by 6 versions), more so than the fastest node's."""
    # node-002's update of version 0 arrives at t = 5 after six folds (t = 1, 2, 2, 3, 4, 4): staleness 6
    records = fedasync().run()
    staleness: dict[str, list[int]] = {n: [] for n in NODES}
    for r in records:
        staleness[r["folded"][0]].append(r["staleness_max"])
    assert staleness["node-002"][0] == 6
    assert all(s > 0 for s in staleness["node-002"])
    assert sum(staleness["node-002"]) / 2 > sum(staleness["node-000"]) / len(staleness["node-000"])


def test_sync_update_slower_than_the_deadline_is_late() -> None:
    """Deadline 10 s, node-002 takes 15 s: each round closes at the deadline with node-002 recorded late."""
    # the other two are aggregated; its update, arriving after the close, is answered with a late receipt
    fed = federation(config(rounds=2), {"node-000": 1.0, "node-001": 2.0, "node-002": 15.0})
    records = fed.run()
    assert fed.engine.state == "finished"
    for r in records:
        assert (r["accepted"], r["late"], r["lost"]) == (["node-000", "node-001"], ["node-002"], [])
        assert r["round_seconds"] == pytest.approx(10.0)
    assert fed.clock.now() == pytest.approx(20.0)
    node = fed.engine.participation.get("node-002")
    assert node is not None and (node.late, node.count) == (2, 0)
    assert [(r.node, r.round, r.status) for r in fed.receipts if r.node == "node-002"] == [("node-002", 0, "late")]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_node_taken_offline_mid_task_is_lost(kind: str) -> None:
    """node-002 (4 s a task) goes offline at t = 2 holding its first task: recorded lost, never sent another."""
    cfg = config(rounds=3) if kind == "sync" else config(engine="async", buffer=2, concurrency=3, aggregations=4)
    fed = federation(cfg, {"node-000": 1.0, "node-001": 1.0, "node-002": 4.0})
    fed.offline("node-002", at=2.0)  # the others, and node-002 until then, are online from the start
    records = fed.run()
    assert fed.engine.state == "finished"
    node = fed.engine.participation.get("node-002")
    assert node is not None and (node.rounds_selected, node.lost, node.count) == (1, 1, 0)
    if kind == "sync":
        assert records[0]["lost"] == ["node-002"] and records[0]["round_seconds"] == pytest.approx(2.0)
        assert all(r["selected"] == ["node-000", "node-001"] for r in records[1:])
    else:
        assert sum(r["lost"] for r in records) == 1
        assert all("node-002" not in r["folded"] for r in records)


def test_the_tasks_carry_what_the_engine_asked_for() -> None:
    """The driver trains each selected node once per task it is sent, with the task's round and attempt."""
    seen: list[tuple[str, int, int]] = []

    def compute(node: str, task: TaskSpec) -> float:
        seen.append((node, task.round, task.attempt))
        return 1.0

    fed = federation(config(rounds=2), dict.fromkeys(NODES, 1.0))
    fed.compute_s = compute
    fed.run()
    assert seen == [(n, r, 0) for r in range(2) for n in NODES]


@pytest.mark.parametrize("engine", ["sync", "async"])
def test_half_calls_never_keep_a_model_holding_inf_and_roll_back_on_request(engine: str) -> None:
    """Issue 31, item 2: finite updates (each passed the non-finite check) that a server step carries
    past float32's range made an infinite global model; the half falls back to the model (and its
    momentum) from before the aggregation and says why, in either engine. `rollback` does the same
    for a model the engine rejects later. The last good model is copied into the same buffers each
    time (no allocation per fold)."""
    spec = get_algorithm("fedavgm")
    half = spec.coordinator(build_hyperparams(spec, {"momentum": 0.0, "server_lr": 10.0}), model=scalar_model(0.5))
    calls = HalfCalls(half, config(engine=engine))
    before = model_sha256(half.model)
    huge = {"weight": torch.full((1, 1), 3e38)}
    updates = [node_update("a", huge, 10), node_update("b", huge, 10)]
    aggregated, _ = calls.aggregate(c.Aggregate(1, context(0, ("a", "b")), updates, []))
    assert aggregated.rejected == "non-finite (weight)" and aggregated.model_sha256 == before
    assert half.model.weight.item() == 0.5

    kept = calls._last_good[0]["weight"] if calls._last_good else None
    fine = [node_update("a", {"weight": torch.full((1, 1), 0.6)}, 10)]
    aggregated, _ = calls.aggregate(c.Aggregate(2, context(1, ("a",)), fine, []))
    assert calls._last_good is not None and calls._last_good[0]["weight"] is kept
    assert aggregated.rejected == "" and half.model.weight.item() == pytest.approx(1.5)  # 0.5 + 10 x 0.1
    calls.rollback()  # the engine found its evaluation collapsed
    assert half.model.weight.item() == 0.5 and model_sha256(half.model) == before
