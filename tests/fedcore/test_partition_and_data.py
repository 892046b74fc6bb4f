"""Datasets and partitions: documented shapes, and splits that are reproducible, disjoint and complete."""

from __future__ import annotations

import numpy as np
import pytest

from fedcore.data import load_dataset
from fedcore.errors import ConfigError
from fedcore.partition import dirichlet, iid, label_histograms, partition


def test_digits_split_shapes_and_labels() -> None:
    """scikit-learn's digits: 1,797 images 1x8x8 in [0, 1], 10 classes, a stratified 25% test split."""
    split = load_dataset("digits", seed=0)
    assert len(split.train) + len(split.test) == 1797
    assert len(split.test) == 450
    assert split.train.input_shape == (1, 8, 8) and split.train.x.dtype.is_floating_point
    assert float(split.train.x.min()) == 0.0 and float(split.train.x.max()) == 1.0
    assert split.train.num_classes == 10 and sorted(set(split.test.y.tolist())) == list(range(10))
    assert min(split.test.label_histogram()) >= 43


def test_unknown_dataset_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError, match="available: digits, synthetic"):
        load_dataset("imagenet", seed=0)


def _labels(n: int = 2000, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, size=n)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 5.0])
def test_dirichlet_is_disjoint_complete_and_meets_min_size(alpha: float) -> None:
    labels = _labels()
    parts = dirichlet(labels, 20, alpha=alpha, seed=3, min_samples=10)
    joined = np.concatenate(parts)
    assert len(joined) == len(labels) and len(np.unique(joined)) == len(labels)
    assert min(len(p) for p in parts) >= 10


def test_dirichlet_is_reproducible_and_seed_dependent() -> None:
    labels = _labels()
    a = dirichlet(labels, 10, alpha=0.3, seed=1)
    b = dirichlet(labels, 10, alpha=0.3, seed=1)
    c = dirichlet(labels, 10, alpha=0.3, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    """Small alpha concentrates each node on few classes (mean per-node label entropy drops)."""
    labels = _labels(5000)

    def mean_entropy(alpha: float) -> float:
        hist = label_histograms(labels, dirichlet(labels, 20, alpha=alpha, seed=0), 10).astype(float)
        p = hist / hist.sum(1, keepdims=True)
        return float(np.mean(-(p * np.log(np.where(p > 0, p, 1))).sum(1)))

    assert mean_entropy(0.1) < mean_entropy(1.0) < mean_entropy(100.0)


def test_dirichlet_impossible_request_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match="needs 1000"):
        dirichlet(_labels(500), 100, alpha=0.5, seed=0, min_samples=10)
    with pytest.raises(ConfigError, match="lower min_samples"):
        dirichlet(_labels(200, classes=2), 10, alpha=0.01, seed=0, min_samples=19, max_attempts=5)


def test_iid_is_balanced_and_complete() -> None:
    parts = iid(_labels(1003), 10, seed=0)
    assert sorted({len(p) for p in parts}) == [100, 101]
    assert len(np.unique(np.concatenate(parts))) == 1003


def test_partition_unknown_kind() -> None:
    with pytest.raises(ConfigError, match="unknown partition"):
        partition("shards", _labels(), 4, seed=0)
