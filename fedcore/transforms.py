"""Batch transforms: preprocessing and augmentation applied to whole batches of tensors.

Datasets keep images as compact uint8 (N x C x H x W) and turn each batch into model input on the
device the batch lives on (the GPU when there is one), never image by image in Python. A
transform is a callable ``(batch, generator) -> batch``; random ones draw only from the generator
they are given (the node's training stream), and ``generator=None`` means "evaluation": no
randomness allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class BatchTransform(Protocol):
    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class Compose:
    steps: tuple[BatchTransform, ...]

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        for step in self.steps:
            x = step(x, generator)
        return x


@dataclass(frozen=True, slots=True)
class ToFloat:
    """uint8 pixels to float32 in [0, 1] (what torchvision's ToTensor does)."""

    scale: float = 255.0

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return x.float().div_(self.scale) if not x.is_floating_point() else x


@dataclass(frozen=True, slots=True)
class Normalize:
    """Per-channel (x - mean) / std, on N x C x ... batches."""

    mean: Sequence[float]
    std: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.mean) != len(self.std) or not self.mean or any(s <= 0 for s in self.std):
            raise ValueError("Normalize needs one mean and one positive std per channel")

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        shape = (1, len(self.mean)) + (1,) * (x.dim() - 2)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return (x - mean) / std
