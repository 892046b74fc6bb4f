"""MobileNetV2, "mobilenetv2": the CIFAR variant of FedVLS's (and CCVR's) code by default.

``variant="cifar"`` (default; fedvls.md 2.2 and A10 recommend it, the published numbers come
from it): 3x3 stride-1 stem with 32 channels + BN + ReLU; inverted-residual blocks following
the (t, c, n, s) table (1,16,1,1), (6,24,2,**1**), (6,32,3,2), (6,64,4,2), (6,96,3,1),
(6,160,3,2), (6,320,1,1); each block is a 1x1 expansion conv + BN + ReLU (also when t = 1),
a 3x3 depthwise conv (stride s) + BN + ReLU and a linear 1x1 projection + BN; a residual is
added whenever the stride is 1, through a 1x1 conv + BN projection when the channel counts
differ; head 1x1 conv 320 -> 1280 + BN + ReLU, global average pooling, ``Linear(1280, K)``.
Plain ReLU, no dropout, bias-free convolutions, PyTorch's default initialisation (as the code).
2,296,922 parameters for 10 classes.

``variant="imagenet"``: the paper's Table 8/9 network (Sandler et al.): stride-2 stem, stage 2
with stride 2, ReLU6, no expansion conv when t = 1, identity residuals only (stride 1 and equal
channels). Its 1x1-conv classifier on the pooled 1x1 map is written as the equivalent
``Linear(1280, K)``; no dropout (the table has none; torchvision adds 0.2). Same parameters as
torchvision's ``mobilenet_v2``: 3,504,872 for 1000 classes.

The head is ``fc``; ``extract`` gives the 1280 pooled features. Taps: ``layer0`` (stem, before
its activation), ``layer1`` ... ``layer4`` (the outputs, linear by construction, of the blocks
closing the 24-, 32-, 96- and 320-channel stages, the last block at each resolution of the CIFAR
variant) and ``features``, all pooled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedmq.fedcore.models.base import FedModel, Taps, choice, image_shape, positive_int, record

IMAGENET_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
"""Each stage's (t, c, n, s): expansion, channels, blocks, first stride (Sandler et al.: the "imagenet" variant)."""
CIFAR_STAGES = (IMAGENET_STAGES[0], (6, 24, 2, 1), *IMAGENET_STAGES[2:])
"""The code's CIFAR table: the paper's with stride 1 in the second stage."""
TAPPED_STAGES = {1: "layer1", 2: "layer2", 4: "layer3", 6: "layer4"}


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear), with the variant's residual rule."""

    def __init__(
        self, in_channels: int, channels: int, expansion: int, stride: int, act: Callable[[], nn.Module], cifar: bool
    ) -> None:
        super().__init__()
        planes = expansion * in_channels
        self.conv1: nn.Module | None = None
        self.bn1: nn.Module | None = None
        if cifar or expansion != 1:
            self.conv1 = nn.Conv2d(in_channels, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, groups=planes, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)
        self.act = act()
        self.residual = stride == 1 and (cifar or in_channels == channels)
        self.shortcut: nn.Module | None = None
        if self.residual and in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x if self.conv1 is None or self.bn1 is None else self.act(self.bn1(self.conv1(x)))
        out = self.bn3(self.conv3(self.act(self.bn2(self.conv2(out)))))
        if self.residual:
            out = out + (x if self.shortcut is None else self.shortcut(x))
        return out


class MobileNetV2(FedModel):
    """MobileNetV2 in the CIFAR variant of FedVLS's code or the paper's ImageNet variant (module docstring)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, *, variant: str = "cifar") -> None:
        super().__init__()
        c, _, _ = image_shape(input_shape)
        self.num_classes = positive_int("num_classes", num_classes)
        cifar = choice("variant", variant, ("cifar", "imagenet")) == "cifar"
        act: Callable[[], nn.Module] = nn.ReLU if cifar else nn.ReLU6
        self.conv1 = nn.Conv2d(c, 32, 3, stride=1 if cifar else 2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.act = act()
        blocks: list[nn.Module] = []
        self.tap_after: dict[int, str] = {}
        in_channels = 32
        for i, (t, channels, n, s) in enumerate(CIFAR_STAGES if cifar else IMAGENET_STAGES):
            for j in range(n):
                blocks.append(InvertedResidual(in_channels, channels, t, s if j == 0 else 1, act, cifar))
                in_channels = channels
            if i in TAPPED_STAGES:
                self.tap_after[len(blocks) - 1] = TAPPED_STAGES[i]
        self.layers = nn.Sequential(*blocks)
        self.conv2 = nn.Conv2d(320, 1280, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(1280)
        self.fc = nn.Linear(1280, num_classes)
        self.feature_shape = (1280,)
        self.tap_names = ("layer0", *TAPPED_STAGES.values(), "features")
        self.head_prefixes = ("fc",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = self.bn1(self.conv1(x))
        record(taps, "layer0", x)
        x = self.act(x)
        for i, block in enumerate(self.layers):
            x = block(x)
            if i in self.tap_after:
                record(taps, self.tap_after[i], x)
        return self.act(self.bn2(self.conv2(x))).mean(dim=(2, 3))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.fc(h)
