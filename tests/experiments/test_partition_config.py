"""`partition:` in an experiment file: one strict model per kind, chosen by `kind`, and wired to
`fedcore.partition` through `experiments.build`; the run directory's partition.json and heat-map."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from fedmq.experiments.build import partition_report, shards
from fedmq.experiments.config import PARTITION_KINDS, DirichletPartition, load_config, parse_config
from fedmq.experiments.plots import partition_heatmap, partition_png
from fedmq.fedcore.data import load_dataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.partition import PARTITIONERS

MINIMAL = {"name": "t", "nodes": 10, "rounds": 1, "data": {"dataset": "synthetic"}}

# each kind as it would be written in YAML, and the options it reaches fedcore.partition with
KINDS: list[tuple[str, dict[str, Any]]] = [
    ("kind: iid", {}),
    ("kind: dirichlet\nalpha: 0.1\nmin_samples: 5", {"alpha": 0.1, "min_samples": 5}),
    ("kind: dirichlet-balanced\nalpha: 0.05", {"alpha": 0.05}),
    (
        "kind: classes\nclasses_per_node: 2\nstyle: fedvls",
        {"classes_per_node": 2, "style": "fedvls", "min_samples": None},
    ),
    ("kind: shards\nshards_per_node: 5", {"shards_per_node": 5}),
    ("kind: quantity\nbeta: 2.0\nmin_samples: 20", {"beta": 2.0, "min_samples": 20}),
]


def _experiment(tmp_path: Path, partition_yaml: str) -> Path:
    body = "\n".join("  " + line for line in partition_yaml.splitlines())
    path = tmp_path / "exp.yaml"
    path.write_text(f"name: t\nnodes: 10\nrounds: 1\ndata:\n  dataset: synthetic\npartition:\n{body}\n")
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_partition_kinds_any_config_kind_has_a_partitioner() -> None:
    """The config's kinds and fedcore's partitioners are the same list."""
    assert list(PARTITION_KINDS) == list(PARTITIONERS)


@pytest.mark.parametrize(("text", "options"), KINDS, ids=[t.splitlines()[0] for t, _ in KINDS])
def test_partition_config_any_kind_loads_from_yaml(tmp_path: Path, text: str, options: dict[str, Any]) -> None:
    """Each kind loads with its own parameters and round-trips through the resolved config."""
    cfg = load_config(_experiment(tmp_path, text))
    assert cfg.partition.kind == text.split("\n")[0].removeprefix("kind: ")
    assert cfg.partition.options() == options
    assert parse_config(yaml.safe_load(cfg.to_yaml())) == cfg


@pytest.mark.parametrize(
    ("kind", "defaults"),
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.5, "min_samples": 10}),
        ("dirichlet-balanced", {"alpha": 0.3}),
        ("classes", {"classes_per_node": 2, "style": "pflib", "min_samples": None}),
        ("shards", {"shards_per_node": 2}),
        ("quantity", {"beta": 0.5, "min_samples": 10}),
    ],
)
def test_partition_config_kind_alone_takes_its_defaults(kind: str, defaults: dict[str, Any]) -> None:
    """`kind` alone is enough; every parameter has a documented default."""
    assert parse_config(MINIMAL | {"partition": {"kind": kind}}).partition.options() == defaults


def test_partition_config_without_kind_is_dirichlet() -> None:
    """Files written before the kinds (no `kind`, or no `partition` at all) keep meaning Dirichlet."""
    assert parse_config(MINIMAL | {"partition": {"alpha": 0.2}}).partition == DirichletPartition(alpha=0.2)
    assert parse_config(MINIMAL).partition == DirichletPartition()


@pytest.mark.parametrize(
    ("partition", "message"),
    [
        ({"kind": "pathological"}, "partition.kind: unknown kind 'pathological'; allowed: iid, dirichlet,"),
        ({"kind": 3}, "partition.kind: unknown kind '3'"),
        ("iid", "partition: expected a mapping with a kind (got 'iid')"),
        ({"kind": "dirichlet", "beta": 1}, "partition.beta: unknown field for kind 'dirichlet'; allowed here: alpha,"),
        ({"kind": "iid", "alpha": 1}, "partition.alpha: unknown field for kind 'iid'; allowed here: kind"),
        (
            {"kind": "classes", "shards_per_node": 2},
            "partition.shards_per_node: unknown field for kind 'classes'; allowed here: classes_per_node, kind,",
        ),
        ({"kind": "dirichlet-balanced", "alpha": 0}, "partition.alpha: Input should be greater than 0"),
        ({"kind": "classes", "classes_per_node": 0}, "partition.classes_per_node: Input should be greater than or"),
        ({"kind": "classes", "style": "flower"}, "partition.style: Input should be 'pflib' or 'fedvls'"),
        ({"kind": "shards", "shards_per_node": 1.5}, "partition.shards_per_node: Input should be a valid integer"),
        ({"kind": "quantity", "beta": -1}, "partition.beta: Input should be greater than 0"),
    ],
)
def test_partition_config_invalid_names_the_field(partition: Any, message: str) -> None:
    """Unknown kinds and fields, and bad values, are errors naming the field and what is allowed."""
    with pytest.raises(ConfigError) as info:
        parse_config(MINIMAL | {"partition": partition}, source="exp.yaml")
    assert message in str(info.value)


def test_partition_config_override_switches_kind(tmp_path: Path) -> None:
    """`--set partition.kind=shards` keeps the file's other partition keys, which must then fit the kind."""
    path = _experiment(tmp_path, "kind: iid")
    assert load_config(path, ["partition.kind=shards"]).partition.options() == {"shards_per_node": 2}
    with pytest.raises(ConfigError, match=r"partition\.alpha: unknown field for kind 'shards'"):
        load_config(_experiment(tmp_path, "kind: dirichlet\nalpha: 0.1"), ["partition.kind=shards"])


@pytest.mark.parametrize(("text", "options"), KINDS, ids=[t.splitlines()[0] for t, _ in KINDS])
def test_shards_any_kind_gives_every_node_its_indices(tmp_path: Path, text: str, options: dict[str, Any]) -> None:
    """experiments.build.shards: node id -> disjoint indices, and the report names kind and parameters."""
    cfg = load_config(_experiment(tmp_path, text))
    split = load_dataset("synthetic", seed=0)
    parts = shards(cfg, split)
    assert list(parts) == cfg.node_ids()
    joined = np.concatenate(list(parts.values()))
    assert len(np.unique(joined)) == len(joined) <= len(split.train)
    report = partition_report(cfg, split)
    assert report["kind"] == cfg.partition.kind and report["parameters"] == options
    assert report["sizes"] == {node: len(idx) for node, idx in parts.items()}
    assert json.loads(json.dumps(report)) == report


def test_partition_png_small_partition_is_a_valid_png(tmp_path: Path) -> None:
    """The run directory's heat-map: a PNG of a sensible size, for a small partition."""
    cfg = parse_config(MINIMAL | {"partition": {"kind": "dirichlet", "alpha": 0.3}})
    path = partition_png(tmp_path / "partition.png", partition_report(cfg, load_dataset("synthetic", seed=0)))
    width, height = _png_size(path)
    assert 600 <= width <= 2500 and 400 <= height <= 1500 and path.stat().st_size > 10_000


@pytest.mark.parametrize(("nodes", "num_classes"), [(1000, 10), (10, 200), (1, 1)])
def test_partition_heatmap_extreme_shapes_stay_within_bounds(tmp_path: Path, nodes: int, num_classes: int) -> None:
    """1,000 nodes, 200 classes or a single cell: still a bounded figure (no giant or empty image)."""
    hist = np.random.default_rng(0).poisson(3.0, size=(nodes, num_classes))
    width, height = _png_size(partition_heatmap(tmp_path / "h.png", hist, title="test"))
    assert 600 <= width <= 2500 and 400 <= height <= 1500


def test_partition_heatmap_bad_histogram_raises(tmp_path: Path) -> None:
    """A histogram that is not nodes x classes is a ValueError, not an empty figure."""
    with pytest.raises(ValueError, match="nodes x classes"):
        partition_heatmap(tmp_path / "h.png", np.zeros(5), title="test")


def test_partition_seed_keeps_the_shards_across_the_experiments_seeds() -> None:
    """`partition.seed` fixes the split while `seed` changes the rest (papers whose trials share one split);
    without it, each experiment seed draws its own shards."""
    split = load_dataset("synthetic", seed=0)

    def parts(experiment_seed: int, **partition: Any) -> dict[str, np.ndarray]:
        spec = {"kind": "dirichlet", "alpha": 0.1, **partition}
        return shards(parse_config(MINIMAL | {"seed": experiment_seed, "partition": spec}), split)

    def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
        return all(np.array_equal(a[node], b[node]) for node in a)

    assert same(parts(0, seed=7), parts(1, seed=7)) and same(parts(5, seed=7), parts(7))
    assert not same(parts(0), parts(1)) and not same(parts(0, seed=7), parts(0, seed=8))
    cfg = parse_config(MINIMAL | {"seed": 3, "partition": {"kind": "iid", "seed": 7}})
    assert partition_report(cfg, split)["seed"] == 7 and "seed" not in cfg.partition.options()
