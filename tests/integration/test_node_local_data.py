"""Deployed nodes on their own data (`fedmq node --data`), as separate processes on mosquitto: each
node process sees an empty data root and cache, so it can only train on its file, and the federation
ends with the same model, bit for bit, as the one whose nodes took their shards of the partition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedmq.experiments.build import save_shard
from fedmq.experiments.config import parse_config
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow


def _run(fed: Federation, nodes: dict[str, list[str]], env: dict[str, str]) -> dict[str, object]:
    """The coordinator, then one node process per id with its extra arguments and this environment."""
    fed.start_coordinator()
    for node_id, extra in nodes.items():
        command = [sys.executable, "-m", "fedmq", "node", "--broker", fed.url, "--config", str(fed.config_path),
                   "--node-id", node_id, "--exit-when-done", "--threads", "1", "--device", "cpu", "-v", *extra]  # fmt: skip
        with (fed.dir / f"{node_id}.log").open("ab") as log:
            fed.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    code = fed.wait(180)
    assert code == 0, fed.log("coordinator.log") + "".join(fed.log(f"{n}.log") for n in nodes)
    return fed.summary()


def test_nodes_on_their_own_mnist_files_train_the_same_model_as_on_the_partition(
    tmp_path: Path, mosquitto_broker: str, data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MNIST: the coordinator (and the reference nodes) read the real data root, the deployed nodes an
    empty one; the unit tests (tests/fednode/test_node_data.py) cover digits and the errors."""
    monkeypatch.setenv("FEDMQ_DATA_ROOT", str(data_root))  # the coordinator's process, the reference, save_shard
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    config = base_config(
        nodes=3, rounds=2, data={"dataset": "mnist"}, model={"name": "mlp", "options": {"hidden": [32]}},
        train={"local_epochs": 1, "batch_size": 64, "lr": 0.05, "momentum": 0.5},
    )  # fmt: skip
    ids = parse_config(config).node_ids()

    (tmp_path / "partition").mkdir()
    reference = Federation(tmp_path / "partition", mosquitto_broker, config)
    expected = _run(reference, {n: [] for n in ids}, env)

    (tmp_path / "own").mkdir()
    deployed = Federation(tmp_path / "own", mosquitto_broker, config)
    files = {}
    for node_id in ids:
        files[node_id] = tmp_path / f"{node_id}.npz"
        save_shard(parse_config(deployed.config), node_id, files[node_id])
    (tmp_path / "empty").mkdir()
    bare = env | {"FEDMQ_DATA_ROOT": str(tmp_path / "empty"), "FEDMQ_CACHE_DIR": str(tmp_path / "empty-cache")}
    summary = _run(deployed, {n: ["--data", str(files[n])] for n in ids}, bare)

    assert summary["state"] == expected["state"] == "finished"
    assert summary["model_sha256"] == expected["model_sha256"]
    assert not (tmp_path / "empty-cache").exists()  # nothing was decoded or cached by the nodes
    for node_id in ids:
        assert f"[{node_id}] round 1: trained" in deployed.log(f"{node_id}.log")
