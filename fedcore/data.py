"""Datasets as whole tensors in memory (small enough here; the data issue adds the image datasets).

A `TensorDataset` is features plus integer labels; nodes batch it with their own generator, with no
DataLoader workers (they cost more than they save for data this size).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from fedcore.errors import ConfigError
from fedcore.seeding import stream
from fedcore.transforms import BatchTransform


@dataclass(frozen=True, slots=True)
class TensorDataset:
    """Inputs (float features, or uint8 images N x C x H x W kept compact) and integer labels.

    Model input comes from `train_batch` and `eval_batch`, which run the transforms on the batch's
    device: `train_transform` (augmentation then normalisation, drawing from the node's generator)
    and `eval_transform` (normalisation only). Without transforms a batch is `x` as stored.
    """

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    train_transform: BatchTransform | None = None
    eval_transform: BatchTransform | None = None

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} labels")

    def train_batch(self, idx: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[idx]
        return (self.train_transform(x, generator) if self.train_transform else x), self.y[idx]

    def eval_batch(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[start:stop]
        return (self.eval_transform(x, None) if self.eval_transform else x), self.y[start:stop]

    def __len__(self) -> int:
        return len(self.y)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def subset(self, indices: np.ndarray) -> TensorDataset:
        idx = torch.as_tensor(indices, dtype=torch.long)
        return replace(self, x=self.x[idx], y=self.y[idx])

    def label_histogram(self) -> list[int]:
        return torch.bincount(self.y, minlength=self.num_classes).tolist()

    def to(self, device: torch.device | str) -> TensorDataset:
        return replace(self, x=self.x.to(device), y=self.y.to(device))


@dataclass(frozen=True, slots=True)
class Split:
    train: TensorDataset
    test: TensorDataset


def _stratified_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = stream(seed, "test-split")
    test_idx: list[np.ndarray] = []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        test_idx.append(idx[: round(len(idx) * test_fraction)])
    test = np.sort(np.concatenate(test_idx))
    train = np.setdiff1d(np.arange(len(y)), test)
    return train, test


def load_digits(*, seed: int, test_fraction: float = 0.25) -> Split:
    """scikit-learn's 8x8 digits (1,797 images, ships with the package, works offline), as 1x8x8 in [0, 1]."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    train, test = _stratified_split(x, y, test_fraction, seed)
    return Split(
        TensorDataset(torch.from_numpy(x[train]), torch.from_numpy(y[train]), 10),
        TensorDataset(torch.from_numpy(x[test]), torch.from_numpy(y[test]), 10),
    )


def load_synthetic(
    *,
    seed: int,
    num_classes: int = 10,
    features: int = 32,
    train_size: int = 2000,
    test_size: int = 500,
    noise: float = 1.0,
) -> Split:
    """Clearly synthetic data for tests: one Gaussian cluster per class around random centres."""
    rng = stream(seed, "synthetic-data")
    centres = rng.normal(0.0, 2.0, size=(num_classes, features)).astype(np.float32)

    def draw(n: int) -> TensorDataset:
        y = rng.integers(0, num_classes, size=n)
        x = centres[y] + rng.normal(0.0, noise, size=(n, features)).astype(np.float32)
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)), num_classes)

    return Split(draw(train_size), draw(test_size))


DATASETS = {"digits": load_digits, "synthetic": load_synthetic}


def load_dataset(name: str, *, seed: int, **options: object) -> Split:
    try:
        loader = DATASETS[name]
    except KeyError:
        raise ConfigError(
            f"unknown dataset {name!r}; available: {', '.join(sorted(DATASETS))}", field="data.dataset"
        ) from None
    try:
        return loader(seed=seed, **options)  # type: ignore[operator]
    except TypeError as exc:
        raise ConfigError(f"bad options for dataset {name!r}: {exc}", field="data") from exc
