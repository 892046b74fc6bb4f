"""The interface every model satisfies, and the option checks the model constructors share.

A model is a feature extractor followed by a classifier head. Algorithms use the split without
knowing the architecture: KDIA feeds generated features to `classify`, MOON reads the
representation, FedRCL reads the taps, and FedVLS, FedACD and FedLC need only the logits.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
from torch import nn

Taps = dict[str, torch.Tensor]


class FedModel(nn.Module, ABC):
    """A classifier split into `extract` (the feature extractor) and `classify` (the head).

    Contracts, for a batch ``x`` of shape ``(B, *input_shape)``:
    - ``extract(x)`` has shape ``(B, *feature_shape)``: exactly what ``classify`` consumes;
    - ``classify(h)`` has shape ``(B, num_classes)``: the logits;
    - ``forward(x)`` is ``classify(extract(x))``, the same operations in the same order, so the
      two are bitwise equal;
    - ``forward_taps(x)`` returns the same logits and a dict of named intermediate features, in
      the order of `tap_names`, each of shape ``(B, d)``: convolutional feature maps are
      global-average-pooled, vectors are flattened. ``"features"`` is always present and equals
      ``extract(x).flatten(1)``;
    - ``represent(x)`` returns ``(z, logits)``, with ``z`` the tap named by `representation_tap`
      (the representation contrastive methods such as MOON compare);
    - ``head_keys()`` lists the state-dict keys of the head: the parameters ``classify`` uses.
    """

    num_classes: int
    feature_shape: tuple[int, ...]
    """Per-sample shape of ``extract(x)``."""
    tap_names: tuple[str, ...]
    """The keys of ``forward_taps(x)[1]``, shallow to deep."""
    head_prefixes: tuple[str, ...]
    """State-dict prefixes of the modules that make up the head."""
    representation_tap: str = "features"

    @property
    def feature_dim(self) -> int:
        """Number of features per sample that the head consumes (``prod(feature_shape)``)."""
        return math.prod(self.feature_shape)

    @abstractmethod
    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        """The extractor; records its taps in ``taps`` when it is given."""

    @abstractmethod
    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        """The head; records its taps (if it has any) in ``taps`` when it is given."""

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return self._extract(x, None)

    def classify(self, h: torch.Tensor) -> torch.Tensor:
        return self._classify(h, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._classify(self._extract(x, None), None)

    def forward_taps(self, x: torch.Tensor) -> tuple[torch.Tensor, Taps]:
        taps: Taps = {}
        h = self._extract(x, taps)
        taps["features"] = h.flatten(1)
        logits = self._classify(h, taps)
        return logits, {name: taps[name] for name in self.tap_names}

    def represent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, taps = self.forward_taps(x)
        return taps[self.representation_tap], logits

    def head_keys(self) -> list[str]:
        return [k for k in self.state_dict() if any(k.startswith(p + ".") for p in self.head_prefixes)]


def record(taps: Taps | None, name: str, t: torch.Tensor) -> None:
    """Store a tap: feature maps global-average-pooled to ``(B, C)``, anything else flattened."""
    if taps is not None:
        taps[name] = t.mean(dim=(2, 3)) if t.dim() == 4 else t.flatten(1)


# option checks: constructors raise ValueError, which build_model turns into a ConfigError naming the model


def image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3 or any(int(d) < 1 for d in input_shape):
        raise ValueError(f"needs C x H x W inputs, got shape {tuple(input_shape)}")
    c, h, w = (int(d) for d in input_shape)
    return c, h, w


def choice(name: str, value: object, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def positive_ints(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a list of positive integers, got {value!r}")
    return tuple(positive_int(f"{name}[{i}]", v) for i, v in enumerate(value))


def spatial_after(size: int, name: str, *steps: tuple[int, int, int]) -> int:
    """The side length after (kernel, stride, padding) steps; an input too small for them is an error."""
    for kernel, stride, padding in steps:
        size = (size + 2 * padding - kernel) // stride + 1
        if size < 1:
            raise ValueError(f"input too small for {name}")
    return size
