"""A node started with other hyperparameters than the coordinator's is refused, and both sides say
which setting differs (over a real broker, with separate processes, as `fedmq run` starts them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


def test_a_node_with_another_mu_is_never_given_a_task(tmp_path: Path, broker_url: str) -> None:
    """FedProx at mu = 0.01; node-002 runs mu = 0.1. Its announcement is refused, it is never live
    nor selected, the run finishes on the other two, and both logs name mu with both values."""
    method = {"name": "fedprox", "hyperparams": {"mu": 0.01}}
    cfg = base_config(nodes=3, rounds=3, method=method, policy={"ack_timeout_s": 3, "min_nodes": 2})
    fed = Federation(tmp_path, broker_url, cfg)
    fed.start_coordinator()
    fed.start_nodes("node-002", changes={"method": {"name": "fedprox", "hyperparams": {"mu": 0.1}}})
    fed.start_nodes("node-000", "node-001", log="nodes.log")
    assert fed.wait() == 0, fed.log("coordinator.log")
    metrics, record = fed.metrics(), fed.participation()
    assert len(metrics) == 3
    for line in metrics:
        assert sorted(line["selected"]) == ["node-000", "node-001"] and line["live"] == 2
    assert record.get("node-002", {}).get("count", 0) == 0
    coordinator_log = fed.log("coordinator.log")
    assert "method-mismatch" in coordinator_log
    assert "mu: 0.01 here, 0.1 on the node" in coordinator_log
    assert fed.summary()["bus"]["rejected"].get("method-mismatch", 0) >= 1
    node_log = fed.log("node-002.log")
    assert "mu: 0.1 here, 0.01 at the coordinator" in node_log and "its tasks will be refused" in node_log
