"""The foundation slice's models ("mlp", "cnn") and FedVLS's MNIST DNN ("dnn").

Their state-dict keys are unchanged from the first version (``net.*``, ``features.*``,
``classifier.*``), so existing checkpoints still load. The head is the last linear layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from fedmq.fedcore.models.base import FedModel, Taps, image_shape, positive_int, positive_ints, record


class MLP(FedModel):
    """Flatten, hidden ReLU layers, linear classifier.

    Taps: ``fc1`` ... ``fc{n-1}`` (the hidden ReLU outputs before the last) and ``features`` (the
    last hidden output, or the flattened input when there is no hidden layer).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (128,)) -> None:
        super().__init__()
        hidden = positive_ints("hidden", hidden)
        self.num_classes = positive_int("num_classes", num_classes)
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        self.feature_shape = (width,)
        self.tap_names = (*(f"fc{i + 1}" for i in range(len(hidden) - 1)), "features")
        self.head_prefixes = (f"net.{len(self.net) - 1}",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        layers = list(self.net)[:-1]
        relus = 0
        for layer in layers:
            x = layer(x)
            if isinstance(layer, nn.ReLU):
                relus += 1
                if relus < len(self.tap_names):
                    record(taps, f"fc{relus}", x)
        return x

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.net[-1](h)


def dnn(input_shape: tuple[int, ...], num_classes: int, *, hidden: Sequence[int] = (200, 200)) -> MLP:
    """FedVLS's MNIST DNN: 784 -> 200 -> 200 -> K with ReLU (fedvls.md 2.2, the code's ``DNN``)."""
    return MLP(input_shape, num_classes, hidden=hidden)


class SmallCNN(FedModel):
    """Two 3x3 conv blocks and a two-layer head, for small images such as 8x8 digits or 28x28 MNIST.

    The extractor ends with the hidden fully connected layer; the head is the last linear layer.
    Taps: ``conv1``, ``conv2`` (pooled conv block outputs) and ``features``.
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, channels: Sequence[int] = (16, 32), hidden: int = 64
    ) -> None:
        super().__init__()
        c, h, w = image_shape(input_shape)
        channels = positive_ints("channels", channels)
        if len(channels) != 2:
            raise ValueError(f"channels must hold two widths, got {list(channels)}")
        hidden = positive_int("hidden", hidden)
        self.num_classes = positive_int("num_classes", num_classes)
        if h < 2 or w < 2:
            raise ValueError(f"input too small for the cnn: {input_shape}")
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
        self.feature_shape = (hidden,)
        self.tap_names = ("conv1", "conv2", "features")
        self.head_prefixes = ("classifier.3",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = self.features[1](self.features[0](x))
        record(taps, "conv1", x)
        x = self.features[4](self.features[3](self.features[2](x)))
        record(taps, "conv2", x)
        return self.classifier[2](self.classifier[1](self.classifier[0](x)))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.classifier[3](h)
