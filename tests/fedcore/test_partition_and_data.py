"""Datasets: documented shapes and labels (the partitions are tested in test_partition.py)."""

from __future__ import annotations

import pytest

from fedcore.data import load_dataset
from fedcore.errors import ConfigError


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
    with pytest.raises(ConfigError, match="available: cifar10, cifar100, cinic10, digits, fashion-mnist, mnist"):
        load_dataset("imagenet", seed=0)
