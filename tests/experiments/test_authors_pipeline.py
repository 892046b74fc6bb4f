"""The FedVLS authors' MNIST pipeline as options (issue 19): ``data.split: {kind: pooled, ...}`` reproduces
their pooled 75/25 re-split exactly (checked against their own calls: ``np.random.seed(1)`` then
sklearn's ``train_test_split(train_size=0.75, shuffle=True)`` on the training images followed by the
test images, ``system/data/generate_mnist.py`` lines 17, 30-31, 99-102 of github.com/krumpguo/FedVLS),
``evaluate_on`` picks the part that is evaluated (their code: the training part, through the swapped
loaders of ``system/main.py`` line 82), and ``train.drop_last`` is refused where a method counts batches."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from fedmq.experiments.build import load_split, shards
from fedmq.experiments.config import parse_config
from fedmq.experiments.grid import load_experiment
from fedmq.fedcore.data import pooled_indices
from fedmq.fedcore.errors import ConfigError

PAPERS = Path(__file__).resolve().parents[2] / "experiments" / "papers"
AUTHORS = {"kind": "pooled", "test_fraction": 0.25, "seed": 1, "evaluate_on": "train_part"}


def config(data: dict[str, object] | None = None, **top: object) -> object:
    return parse_config({"name": "t", "nodes": 2, "rounds": 1, "data": data or {}, **top})


@pytest.fixture
def global_numpy_state() -> Iterator[None]:
    """The authors' code seeds NumPy's global generator: put it back afterwards."""
    state = np.random.get_state()  # noqa: NPY002 (the legacy global generator is what their code uses)
    yield
    np.random.set_state(state)  # noqa: NPY002


def _their_split(x: np.ndarray, y: np.ndarray, train_size: float = 0.75) -> list[np.ndarray]:
    """generate_mnist.py as it runs: np.random.seed(1) at import (line 17), and nothing draws from
    NumPy's global generator before split_data's train_test_split (lines 30-31)."""
    from sklearn.model_selection import train_test_split

    np.random.seed(1)  # noqa: NPY002 (their call)
    return train_test_split(x, y, train_size=train_size, shuffle=True)


@pytest.mark.parametrize(("n", "test_fraction"), [(70_000, 0.25), (1_797, 0.25), (1_001, 0.3)])
def test_pooled_indices_are_the_authors_train_test_split(
    global_numpy_state: None, n: int, test_fraction: float
) -> None:
    """The same parts, in the same order, as their calls; 70,000 images give 52,500 and 17,500."""
    train, held = pooled_indices(n, test_fraction, seed=1)
    x_train, x_test, _, _ = _their_split(np.arange(n), np.arange(n), train_size=1 - test_fraction)
    assert np.array_equal(train, x_train) and np.array_equal(held, x_test)
    assert len(train) + len(held) == n and len(np.union1d(train, held)) == n
    if n == 70_000:
        assert (len(train), len(held)) == (52_500, 17_500)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("authors", "data.split: expected official or a mapping with kind: pooled (fields: kind, test_fraction"),
        (
            {"kind": "resplit", "evaluate_on": "train_part"},
            "data.split: unknown split kind 'resplit'; allowed: pooled, per_node",
        ),
        ("authors", "or kind: per_node (fields: kind, test_fraction, pool)"),
        ({"kind": "pooled"}, "data.split: evaluate_on: Field required (allowed fields: kind, test_fraction, seed"),
        (
            {**AUTHORS, "evaluate_on": "test"},
            "data.split: evaluate_on: Input should be 'train_part' or 'held_out_part'",
        ),
        ({**AUTHORS, "test_fraction": 1.0}, "data.split: test_fraction: Input should be less than 1"),
        ({**AUTHORS, "shuffle": True}, "data.split: shuffle: unknown field (allowed fields: kind, test_fraction"),
    ],
)
def test_bad_split_gives_one_readable_error(split: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config({"split": split})
    assert message in str(info.value)
    assert str(info.value).count("\n") == 1


def test_split_and_drop_last_read_as_their_defaults_from_a_run_made_before_them() -> None:
    """A run's config written before these options existed reads as today's with their defaults (so a
    finished grid cell is kept, `grid.cell_is_done`); set, they are in the dump."""
    default = config()
    old = default.model_dump(mode="json")  # type: ignore[attr-defined]
    del old["data"]["split"], old["train"]["drop_last"]
    assert parse_config(old) == default
    dump = config({"split": AUTHORS}, train={"drop_last": True}).model_dump(mode="json")  # type: ignore[attr-defined]
    assert dump["data"]["split"] == AUTHORS and dump["train"]["drop_last"] is True


@pytest.mark.parametrize("method", ["kdia", "fedacd", "fedproto"])
def test_drop_last_is_refused_for_methods_that_count_local_batches(method: str) -> None:
    with pytest.raises(ConfigError, match=f"train.drop_last: {method} counts local_sgd's batches"):
        config(method={"name": method}, train={"drop_last": True})
    config(method={"name": method})
    config(method={"name": "fedvls"}, train={"drop_last": True})


def test_the_authors_configs_load_with_the_authors_pipeline() -> None:
    """The 3-seed grid (12 cells) and its twin differ only in the pipeline; the reduced twin keeps 8 methods."""
    official = load_experiment(PAPERS / "fedvls-beta005-seeds.yaml")
    authors = load_experiment(PAPERS / "fedvls-beta005-seeds-authors.yaml")
    assert len(official.cells) == len(authors.cells) == 12
    for a, b in zip(official.cells, authors.cells, strict=True):
        assert a.labels == b.labels
        assert (a.config.data.split, a.config.train.drop_last, a.config.partition.min_samples) == (
            "official",
            False,
            10,
        )  # type: ignore[union-attr]
        assert b.config.data.split.model_dump() == AUTHORS  # type: ignore[union-attr]
        assert (b.config.train.drop_last, b.config.partition.min_samples, b.config.rounds) == (True, 256, 50)  # type: ignore[union-attr]
    reduced = load_experiment(PAPERS / "fedvls-beta005-authors.yaml")
    assert len(reduced.cells) == 8 and reduced.cells[0].config.data.split.model_dump() == AUTHORS  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def mnist_root(data_root: Path) -> Path:
    if not (data_root / "mnist").is_dir():
        if os.environ.get("FEDMQ_REQUIRE_DATA"):
            pytest.fail(f"FEDMQ_REQUIRE_DATA is set but {data_root} has no mnist folder")
        pytest.skip(f"no MNIST under {data_root}")
    return data_root


def _mnist(root: Path, cache: Path, split: object, **top: object) -> object:
    return config({"dataset": "mnist", "root": str(root), "cache_dir": str(cache), "split": split}, **top)


def test_pooled_mnist_is_the_authors_split(mnist_root: Path, tmp_path: Path, global_numpy_state: None) -> None:
    """On MNIST: 52,500 training and 17,500 held-out images, image for image what their code makes;
    evaluate_on train_part evaluates the training part itself; the same on every load."""
    official = load_split(_mnist(mnist_root, tmp_path, "official"))  # type: ignore[arg-type]
    theirs = load_split(_mnist(mnist_root, tmp_path, AUTHORS))  # type: ignore[arg-type]
    paper = load_split(_mnist(mnist_root, tmp_path, {**AUTHORS, "evaluate_on": "held_out_part"}))  # type: ignore[arg-type]
    assert (len(theirs.train), len(theirs.test), len(paper.test)) == (52_500, 52_500, 17_500)
    assert theirs.test is theirs.train
    assert torch.equal(paper.train.x, theirs.train.x) and torch.equal(paper.train.y, theirs.train.y)
    # their generate_mnist: training images then test images (lines 99-102), then train_test_split
    x = np.concatenate([official.train.x.numpy(), official.test.x.numpy()])
    y = np.concatenate([official.train.y.numpy(), official.test.y.numpy()])
    x_train, x_test, y_train, y_test = _their_split(x, y)
    assert np.array_equal(theirs.train.x.numpy(), x_train) and np.array_equal(theirs.train.y.numpy(), y_train)
    assert np.array_equal(paper.test.x.numpy(), x_test) and np.array_equal(paper.test.y.numpy(), y_test)
    again = load_split(_mnist(mnist_root, tmp_path, AUTHORS))  # type: ignore[arg-type]
    assert torch.equal(again.train.x, theirs.train.x) and torch.equal(again.train.y, theirs.train.y)
    # their transforms: ToTensor then Normalize(0.5, 0.5) (line 72) is fedmq's normalize: half
    assert theirs.train.eval_transform is not None


def test_authors_partition_gives_every_node_256_samples_of_the_training_part(mnist_root: Path, tmp_path: Path) -> None:
    """Dirichlet 0.05 over 10 nodes, redrawn until each has 256 samples (generate_mnist.py lines 23, 201)."""
    cfg = _mnist(
        mnist_root, tmp_path, AUTHORS, nodes=10, partition={"kind": "dirichlet", "alpha": 0.05, "min_samples": 256}
    )
    parts = shards(cfg, load_split(cfg))  # type: ignore[arg-type]
    sizes = [len(p) for p in parts.values()]
    assert min(sizes) >= 256 and sum(sizes) == 52_500
