"""A deployed node on its own data (`fedmq node --data PATH`): built from that file alone, never from
the experiment's dataset or partition; refused with exit code 2 for several nodes or a bad file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedmq.experiments.build
from fedmq.experiments.build import build_nodes, load_split, save_shard, shards
from fedmq.experiments.cli import main
from fedmq.experiments.config import parse_config
from fedmq.fedcore.errors import ConfigError

URL = "mqtt://127.0.0.1:1"  # never connected to: the daemons are only built


def _config(dataset: str = "mnist", **changes: object) -> dict[str, object]:
    return {
        "name": "local", "seed": 3, "nodes": 4, "rounds": 1,
        "data": {"dataset": dataset}, "model": {"name": "mlp", "options": {"hidden": [16]}}, **changes,
    }  # fmt: skip


@pytest.fixture
def no_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty data root and cache, and a load_split that fails: nothing may read the dataset."""
    (tmp_path / "empty-root").mkdir()
    monkeypatch.setenv("FEDMQ_DATA_ROOT", str(tmp_path / "empty-root"))
    monkeypatch.setenv("FEDMQ_CACHE_DIR", str(tmp_path / "empty-cache"))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the dataset was loaded")

    monkeypatch.setattr(fedmq.experiments.build, "load_split", refuse)
    monkeypatch.setattr(fedmq.experiments.build, "shards", refuse)


def test_node_with_data_is_built_from_its_file_with_no_dataset_on_the_machine(tmp_path: Path, no_dataset: None) -> None:
    """MNIST experiment, empty FEDMQ_DATA_ROOT: the node takes the .npz's examples, the experiment's
    normalisation, and a model for the dataset's input shape and classes."""
    x = np.random.default_rng(0).integers(0, 256, size=(12, 28, 28), dtype=np.uint8)  # channels-less: accepted
    y = np.arange(12) % 10
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    cfg = parse_config(_config())
    (node,) = build_nodes(cfg, URL, ["node-002"], device=torch.device("cpu"), data_path=tmp_path / "mine.npz")
    assert node.node_id == "node-002" and len(node.data) == 12 and node.data.input_shape == (1, 28, 28)
    assert node.data.label_histogram() == [2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    batch, _ = node.data.eval_batch(0, 12)
    assert torch.allclose(batch, (torch.from_numpy(x[:, None]).float() / 255 - 0.1307) / 0.3081, atol=1e-5)
    logits = node.workspace.model(batch)
    assert logits.shape == (12, 10)


def test_node_with_its_saved_shard_equals_the_node_on_the_partition(tmp_path: Path) -> None:
    """save_shard writes a node's shard as a --data file; the node built from it holds the same
    examples and transforms, and the same initial model, as the node built from the partition."""
    cfg = parse_config(_config("digits"))
    n = save_shard(cfg, "node-001", tmp_path / "shard.npz")
    assert n == len(shards(cfg, load_split(cfg))["node-001"])
    cpu = torch.device("cpu")
    (mine,) = build_nodes(cfg, URL, ["node-001"], device=cpu, data_path=tmp_path / "shard.npz")
    (theirs,) = build_nodes(cfg, URL, ["node-001"], device=cpu)
    assert torch.equal(mine.data.x, theirs.data.x) and torch.equal(mine.data.y, theirs.data.y)
    assert mine.data.train_transform == theirs.data.train_transform
    state, other = mine.workspace.model.state_dict(), theirs.workspace.model.state_dict()
    assert all(torch.equal(state[k], other[k]) for k in state)


@pytest.mark.parametrize("ids", [["node-000", "node-001"], ["all"]])
def test_data_with_several_nodes_is_refused(tmp_path: Path, no_dataset: None, ids: list[str]) -> None:
    """One node, one dataset: several --node-id (or 'all') with --data is a configuration error."""
    np.savez(tmp_path / "mine.npz", x=np.zeros((2, 1, 28, 28), np.uint8), y=np.zeros(2, np.int64))
    cfg = parse_config(_config())
    node_ids = cfg.node_ids() if ids == ["all"] else ids
    with pytest.raises(ConfigError, match="one --node-id"):
        build_nodes(cfg, URL, node_ids, data_path=tmp_path / "mine.npz")


def _cli(tmp_path: Path, *args: str) -> int:
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(_config()))
    return main(["node", "--broker", URL, "--config", str(tmp_path / "exp.yaml"), "--device", "cpu", *args])


def test_cli_node_data_errors_exit_2_and_name_the_file(
    tmp_path: Path, no_dataset: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Several nodes, labels beyond the experiment's classes, a missing file: exit 2, a one-line reason."""
    path = tmp_path / "mine.npz"
    np.savez(path, x=np.zeros((2, 1, 28, 28), np.uint8), y=np.array([3, 12]))
    assert _cli(tmp_path, "--node-id", "node-000", "--node-id", "node-001", "--data", str(path)) == 2
    assert "one --node-id" in capsys.readouterr().err
    assert _cli(tmp_path, "--node-id", "node-000", "--data", str(path)) == 2
    err = capsys.readouterr().err
    assert f"fedmq: data error: {path}: y holds labels 3..12" in err and "10 classes, 0..9" in err
    assert _cli(tmp_path, "--node-id", "node-000", "--data", str(tmp_path / "nope.npz")) == 2
    assert "nope.npz does not exist" in capsys.readouterr().err
