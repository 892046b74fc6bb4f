"""KDIA and its baselines through the daemons: a coordinator and node processes over a real broker."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest

from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow

SMALL_GENERATOR = {"gen_epochs": 1, "gen_batches_per_epoch": 5, "gen_batch_size": 16, "noise_dim": 8}


def test_kdia_teacher_weights_follow_the_participation_record(tmp_path: Path, broker_url: str) -> None:
    """6 nodes, C = 0.5, 5 rounds, node k's training failing in round k mod 5: every round's logged
    teacher weights are triFreqs of the (t_k, n_k, N_k) that the accepted lists of metrics.jsonl
    give (a selected node that failed keeps its old values), the last round's equal the saved
    participation record, and the student and the teacher are both evaluated."""
    cfg = base_config(
        nodes=6,
        fraction=0.5,
        rounds=5,
        data={"dataset": "digits", "validation_fraction": 0.1},
        method={"name": "kdia", "hyperparams": {"lambda_gen": 0.1, **SMALL_GENERATOR}},
        faults={f"node-{k:03d}": {"error_at_round": k % 5} for k in range(6)},
    )
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002", log="nodes-a.log")
    fed.start_nodes("node-003", "node-004", "node-005", log="nodes-b.log")
    assert fed.wait(180) == 0, fed.log("coordinator.log")
    summary, metrics, record = fed.summary(), fed.metrics(), fed.participation()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 5
    assert summary["final_model"] in ("global", "teacher")
    assert all(0 <= m["accuracy_teacher"] <= 1 and 0 <= m["val_accuracy_teacher"] <= 1 for m in metrics)
    assert all(m["gen_ce"] > 0 and m["teacher_models_held"] >= 1 for m in metrics if m["aggregated"])

    logged: dict[int, dict[str, dict]] = defaultdict(dict)
    for line in (fed.out / "teacher_weights.jsonl").read_text().splitlines():
        entry = json.loads(line)
        logged[entry["round"]][entry["node_id"]] = entry
    assert sorted(logged) == [m["round"] for m in metrics if m["aggregated"]]

    last: dict[str, int] = {}
    count: dict[str, int] = defaultdict(int)
    for m in metrics:
        if not m["aggregated"]:
            continue
        for node in m["accepted"]:
            last[node], count[node] = m["round"], count[node] + 1
        t, weights = m["round"], logged[m["round"]]
        mass = {n: math.exp((last[n] - t) / 3) * (count[n] * record[n]["num_samples"]) ** (1 / 3) for n in last}
        total = sum(mass.values())
        for node, entry in weights.items():
            assert entry["last_round"] == last.get(node, -1) and entry["count"] == count[node], (t, node)
            assert entry["weight"] == pytest.approx(mass.get(node, 0.0) / total, rel=1e-9, abs=1e-12), (t, node)
    assert sum(len(m["failed"]) for m in metrics) >= 1, "no selected node failed: the test checks nothing"
    for node, entry in logged[max(logged)].items():
        assert entry["count"] == record[node]["count"] and entry["last_round"] == record[node]["last_round"]


@pytest.mark.parametrize(
    ("method", "hyperparams"),
    [
        ("fedavgm", {}),
        ("fedprox", {"mu": 0.1}),
        ("moon", {}),
        ("fedgkd", {"buffer_size": 2}),
        ("feddisco", {}),
        ("kdia", {"teacher_mode": "streaming", **SMALL_GENERATOR}),
        ("scaffold", {"control_update": "gradient_mean"}),
        ("feddyn", {}),
        ("fedlc", {}),
        ("fedrs", {}),
        ("fedvls", {}),
        ("fedntd", {}),
        ("feddecorr", {}),
        ("fednh", {}),
        ("fedproto", {}),
        ("fedrcl", {}),
        ("fedsa", {}),
        ("fedacd", {}),
    ],
)
def test_each_method_learns_through_the_daemons(
    tmp_path: Path, embedded_broker: str, method: str, hyperparams: dict
) -> None:
    cfg = base_config(nodes=3, rounds=3, method={"name": method, "hyperparams": hyperparams})
    fed = Federation(tmp_path, embedded_broker, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002")
    assert fed.wait(120) == 0, fed.log("coordinator.log") + fed.log("node-000.log")
    summary, metrics = fed.summary(), fed.metrics()
    assert summary["state"] == "finished" and summary["rounds_completed"] == 3
    assert all(m["accepted"] == m["selected"] for m in metrics)
    assert summary["final_accuracy"] > 0.5, metrics
    assert summary["bus"]["rejected"] == {}


def test_fedsa_rule_replaces_the_mean_of_another_method(tmp_path: Path, broker_url: str) -> None:
    """FedProx with `method.aggregator: fedsa` over each real broker: the run learns, and every round's
    metrics carry the statistics of FedSA's rule (so it, not the mean, averaged the models)."""
    cfg = base_config(
        nodes=4,
        rounds=3,
        method={"name": "fedprox", "hyperparams": {"mu": 0.01}, "aggregator": {"name": "fedsa"}},
    )
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-000", "node-001", "node-002", "node-003")
    assert fed.wait(120) == 0, fed.log("coordinator.log")
    summary = fed.summary()
    assert summary["state"] == "finished" and summary["final_accuracy"] > 0.5
    assert summary["bus"]["rejected"] == {}
    metrics = fed.metrics()
    assert all(0 < m["sa_high_share"] < 1 and m["sa_layers_clustered"] >= 1 for m in metrics), metrics
