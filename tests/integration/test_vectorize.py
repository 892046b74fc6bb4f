"""hosting.vectorize through the daemons: a process's selected nodes train as one group each round,
and the federation learns what it learns with one-by-one training, within float tolerance."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


def _run(tmp_path: Path, broker_url: str, vectorize: bool) -> tuple[list[dict[str, Any]], str]:
    """6 nodes in one process, C = 0.5: three nodes of the process train each round."""
    directory = tmp_path / ("vectorized" if vectorize else "one-by-one")
    directory.mkdir()
    cfg = base_config(nodes=6, fraction=0.5, rounds=4, hosting={"vectorize": vectorize})
    fed = Federation(directory, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes(*[f"node-00{i}" for i in range(6)], log="nodes.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    assert fed.summary()["bus"]["rejected"] == {}
    return fed.metrics(), (directory / "nodes.log").read_text(errors="replace")


def test_vectorized_nodes_learn_what_one_by_one_nodes_learn(tmp_path: Path, broker_url: str) -> None:
    """Same seed, vectorize off then on: the same cohorts, and every round's train loss, test loss and
    accuracy equal within tolerance (SGD weights agree to about 1e-7, see tests/fedcore/test_vectorized.py,
    so a prediction on the 450 test images could flip only at a near tie: 0.01 allows 4); with it on,
    each round's three nodes trained together."""
    off, off_log = _run(tmp_path, broker_url, vectorize=False)
    on, on_log = _run(tmp_path, broker_url, vectorize=True)
    assert "trained together" not in off_log
    together = re.findall(r"round (\d+): (\d+) nodes trained together", on_log)
    assert together == [(str(r), "3") for r in range(4)], on_log[-3000:]
    assert [m["selected"] for m in on] == [m["selected"] for m in off]
    assert all(m["accepted"] == m["selected"] for m in on)
    for a, b in zip(off, on, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
        assert b["accuracy"] == pytest.approx(a["accuracy"], abs=0.01)
    assert on[-1]["accuracy"] > on[0]["accuracy"]


def test_vectorized_nodes_with_faults_group_without_the_faulty_ones(tmp_path: Path, broker_url: str) -> None:
    """With vectorize on, node-001's training fails in round 1 and node-002 crashes on round 2's model:
    neither is waited for (both train, or fail, on their own), the others of those rounds train as
    a group, the failure and the loss are recorded as without grouping, and every round completes."""
    cfg = base_config(
        nodes=4, rounds=4, deadline_s=60, hosting={"vectorize": True, "vectorize_wait_s": 30},
        faults={"node-001": {"error_at_round": 1}, "node-002": {"fail_at_round": 2}},
    )  # fmt: skip
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes(*[f"node-00{i}" for i in range(4)], log="nodes.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics = fed.metrics()
    assert metrics[1]["failed"] == ["node-001"] and metrics[1]["accepted"] == ["node-000", "node-002", "node-003"]
    assert metrics[2]["lost"] == ["node-002"] and metrics[2]["accepted"] == ["node-000", "node-001", "node-003"]
    assert metrics[3]["accepted"] == ["node-000", "node-001", "node-003"]
    log = (tmp_path / "nodes.log").read_text()
    assert "group starts without" not in log, "a group waited out its bound for a node that would not come"
    together = re.findall(r"round (\d+): (\d+) nodes trained together", log)
    assert together == [("0", "4"), ("1", "3"), ("2", "3"), ("3", "3")]
    assert fed.summary()["rounds_completed"] == 4
