"""Small convolutional networks of the papers: MOON/KDIA's simple CNN, McMahan et al.'s CNN, FedROD's CNN.

All three use PyTorch's default initialisation, as their reference code does.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.models.base import FedModel, Taps, flag, image_shape, positive_int, record, spatial_after


class MoonCNN(FedModel):
    """MOON's simple CNN with its projection head, as KDIA uses it ("moon-cnn"; kdia.md 1.1).

    Conv(3->6, 5) -> MaxPool(2) -> ReLU -> Conv(6->16, 5) -> MaxPool(2) -> ReLU gives 16x5x5 on
    32x32 inputs; then Flatten -> fc1 (400->120) -> ReLU -> fc2 (120->84) -> ReLU -> l1 (84->84)
    -> ReLU -> l2 (84->projection_dim, MOON's projection head, no activation) -> l3 (-> K).

    The split is KDIA's: the convolutional part is the extractor, *all* the linear layers are the
    classifier. So ``extract(x)`` is the 16x5x5 map (the generator's target) and ``classify``
    takes such a map (flattening it itself). 2,872 extractor and 89,754 head parameters for
    CIFAR-10. Taps: ``conv1`` (pooled), ``features`` (the flattened 400), ``fc1``, ``fc2`` (84,
    MOON's h) and ``projection`` (MOON's z, the `representation_tap`).
    """

    representation_tap = "projection"

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, projection_dim: int = 256) -> None:
        super().__init__()
        c, h, w = image_shape(input_shape)
        projection_dim = positive_int("projection_dim", projection_dim)
        self.num_classes = positive_int("num_classes", num_classes)
        steps = ((5, 1, 0), (2, 2, 0), (5, 1, 0), (2, 2, 0))
        fh, fw = spatial_after(h, "moon-cnn", *steps), spatial_after(w, "moon-cnn", *steps)
        self.conv1 = nn.Conv2d(c, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.pool = nn.MaxPool2d(2)  # a module: vectorised training pools the nodes as one (fedcore.layers_over_nodes)
        self.fc1 = nn.Linear(16 * fh * fw, 120)
        self.fc2 = nn.Linear(120, 84)
        self.l1 = nn.Linear(84, 84)
        self.l2 = nn.Linear(84, projection_dim)
        self.l3 = nn.Linear(projection_dim, num_classes)
        self.feature_shape = (16, fh, fw)
        self.tap_names = ("conv1", "features", "fc1", "fc2", "projection")
        self.head_prefixes = ("fc1", "fc2", "l1", "l2", "l3")

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = F.relu(self.pool(self.conv1(x)))
        record(taps, "conv1", x)
        return F.relu(self.pool(self.conv2(x)))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = F.relu(self.fc1(h.flatten(1)))
        record(taps, "fc1", x)
        x = F.relu(self.fc2(x))
        record(taps, "fc2", x)
        z = self.l2(F.relu(self.l1(x)))
        record(taps, "projection", z)
        return self.l3(z)


class FedAvgCNN(FedModel):
    """The CNN of McMahan et al. (2017), "fedavg-cnn".

    Two 5x5 convolutions with 32 and 64 channels ('same' padding), each followed by ReLU and 2x2
    max-pooling, a 512-unit ReLU layer and a linear classifier: 1,663,370 parameters on 28x28
    MNIST, 2,156,490 on 3x32x32 images (10 classes). The head is the last linear layer
    (``extract`` gives the 512 features). Taps: ``conv1``, ``conv2`` (pooled) and ``features``.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        c, h, w = image_shape(input_shape)
        self.num_classes = positive_int("num_classes", num_classes)
        steps = ((2, 2, 0), (2, 2, 0))
        fh, fw = spatial_after(h, "fedavg-cnn", *steps), spatial_after(w, "fedavg-cnn", *steps)
        self.conv1 = nn.Conv2d(c, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.pool = nn.MaxPool2d(2)  # a module: vectorised training pools the nodes as one (fedcore.layers_over_nodes)
        self.fc1 = nn.Linear(64 * fh * fw, 512)
        self.fc = nn.Linear(512, num_classes)
        self.feature_shape = (512,)
        self.tap_names = ("conv1", "conv2", "features")
        self.head_prefixes = ("fc",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        record(taps, "conv1", x)
        x = self.pool(F.relu(self.conv2(x)))
        record(taps, "conv2", x)
        return F.relu(self.fc1(x.flatten(1)))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.fc(h)


class Conv2Cifar(FedModel):
    """FedROD's CNN as the FedNH code defines it ("conv2cifar"; fedacd.md 2.2).

    Conv(3->64, 5) -> ReLU -> MaxPool(2) -> Conv(64->64, 5) -> ReLU -> MaxPool(2) -> Flatten
    (1600 on 32x32) -> fc1 (->384) -> ReLU -> fc2 (->192) -> ReLU -> fc (192 -> K). FedNH's last
    layer has no bias (``head_bias=False``, the default): 797,952 parameters for 10 classes
    (the spec's "about 0.80M"). The head is the last linear layer. Taps: ``conv1``, ``conv2``
    (pooled), ``fc1`` and ``features`` (192).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, head_bias: bool = False) -> None:
        super().__init__()
        c, h, w = image_shape(input_shape)
        head_bias = flag("head_bias", head_bias)
        self.num_classes = positive_int("num_classes", num_classes)
        steps = ((5, 1, 0), (2, 2, 0), (5, 1, 0), (2, 2, 0))
        fh, fw = spatial_after(h, "conv2cifar", *steps), spatial_after(w, "conv2cifar", *steps)
        self.conv1 = nn.Conv2d(c, 64, 5)
        self.conv2 = nn.Conv2d(64, 64, 5)
        self.pool = nn.MaxPool2d(2)  # a module: vectorised training pools the nodes as one (fedcore.layers_over_nodes)
        self.fc1 = nn.Linear(64 * fh * fw, 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc = nn.Linear(192, num_classes, bias=head_bias)
        self.feature_shape = (192,)
        self.tap_names = ("conv1", "conv2", "fc1", "features")
        self.head_prefixes = ("fc",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        record(taps, "conv1", x)
        x = self.pool(F.relu(self.conv2(x)))
        record(taps, "conv2", x)
        x = F.relu(self.fc1(x.flatten(1)))
        record(taps, "fc1", x)
        return F.relu(self.fc2(x))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.fc(h)
