"""Datasets: documented shapes and labels (the partitions are tested in test_partition.py)."""

from __future__ import annotations

import pytest
import torch

from fedmq.fedcore.data import load_dataset
from fedmq.fedcore.errors import ConfigError


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


def test_validation_hold_out_is_stratified_disjoint_and_seeded() -> None:
    """A 10% validation split leaves the test set alone, takes ~10% of every class, and is reproducible."""
    from fedmq.fedcore.data import hold_out_validation, load_digits

    split = load_digits(seed=0)
    a, b = hold_out_validation(split, 0.1, seed=3), hold_out_validation(split, 0.1, seed=3)
    assert a.val is not None and torch.equal(a.val.y, b.val.y) and torch.equal(a.test.y, split.test.y)
    assert len(a.train) + len(a.val) == len(split.train)
    per_class = torch.bincount(a.val.y, minlength=10).float() / torch.bincount(split.train.y, minlength=10).float()
    assert torch.all((per_class - 0.1).abs() < 0.02), per_class
    c = hold_out_validation(split, 0.1, seed=4)
    assert c.val is not None and not torch.equal(a.val.x, c.val.x)
    with pytest.raises(ConfigError, match=r"data\.validation_fraction"):
        hold_out_validation(split, 1.5, seed=0)
