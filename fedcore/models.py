"""Small models for the foundation slice; the paper models come with the data issue.

Models are built from a name in the config through `build_model`, so daemons never name one.
Initialisation draws from its own seeded stream and leaves torch's global generator untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from fedcore.errors import ConfigError


class MLP(nn.Module):
    """Flatten, hidden ReLU layers, linear classifier."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (128,)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two 3x3 conv blocks and a two-layer head, for small images such as 8x8 digits or 28x28 MNIST."""

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, channels: tuple[int, int] = (16, 32), hidden: int = 64
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ConfigError(f"the cnn needs C x H x W inputs, got shape {input_shape}", field="model")
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, channels[0], 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels[0], channels[1], 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels[1] * (h // 2) * (w // 2), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": MLP, "cnn": SmallCNN}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int, **options: object
) -> nn.Module:
    try:
        factory = MODELS[name]
    except KeyError:
        raise ConfigError(
            f"unknown model {name!r}; available: {', '.join(sorted(MODELS))}", field="model.name"
        ) from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return factory(input_shape, num_classes, **options)
        except TypeError as exc:
            raise ConfigError(f"bad options for model {name!r}: {exc}", field="model") from exc


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
