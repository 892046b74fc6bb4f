"""ResNets with BasicBlocks: "resnet18" and "resnet34" (four stages) and the CIFAR "resnet32" (three).

State-dict keys follow torchvision (``conv1``, ``bn1``, ``layerN.i.conv1``, ``...downsample.0``,
``fc``); the normalisation modules keep the ``bn`` names when they are GroupNorm, as in FedNH.

resnet18 / resnet34 options:
- ``norm``: ``"bn"`` (BatchNorm, default) or ``"gn"`` (GroupNorm with ``groups`` groups, default
  2: FedRCL and FedNH/FedACD use GroupNorm(2) everywhere, shortcuts included);
- ``stem``: ``"cifar"`` (default: 3x3 stride-1 conv, no max-pool; FedRCL, FedACD and MOON/KDIA's
  ResNet option) or ``"imagenet"`` (7x7 stride-2 conv + 3x3 stride-2 max-pool, torchvision's
  ``resnet18``/``resnet34`` as the FedSA (PFLlib) and FedVLS code use them even on 32x32 inputs;
  fedvls.md A11 recommends it to reproduce FedVLS Table 3, fedsa.md 2 to reproduce FedSA);
- ``head_bias``: bias of the final linear layer (default true; FedNH/FedACD's is bias-free);
- ``init``: ``"code"`` (default) initialises as the reference code does, torchvision's
  ``kaiming_normal_(mode="fan_out", nonlinearity="relu")`` on convolutions (FedSA and FedVLS use
  torchvision's model; FedNH's ResNet draws the same normal(0, sqrt(2 / (k*k*out)))); the
  FedRCL model file was not audited and may differ. ``"pytorch"`` keeps PyTorch's defaults.

resnet32 (FedVLS Table 3; the code ports akamaster's CIFAR ResNet): 3x3 16-channel stem, three
stages of five BasicBlocks with 16/32/64 channels, the parameter-free "option A" shortcut (stride-2
subsampling and zero channel padding), GAP and ``Linear(64, K)``; 464,154 parameters for 10
classes (He et al.'s 0.46M). Options ``norm``, ``groups``, ``head_bias`` and ``init``; its
``"code"`` init is the code's ``kaiming_normal_`` (fan_in) on every conv and linear weight.

Taps (FedRCL, fedrcl.md 1.4): ``layer0`` = norm(conv1(x)) before its ReLU (and before the
max-pool), ``layer1`` ... ``layerN`` = the last block of each stage after the residual addition
and before its ReLU, each global-average-pooled; then ``features`` = GAP(ReLU(last stage)), the
vector the linear head consumes. No projection head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.models.base import FedModel, Taps, choice, flag, image_shape, positive_int, record

Norm = Callable[[int], nn.Module]


def _norm_layer(norm: str, groups: int, widths: Sequence[int]) -> Norm:
    norm = choice("norm", norm, ("bn", "gn"))
    if norm == "bn":
        return nn.BatchNorm2d
    groups = positive_int("groups", groups)
    for width in widths:
        if width % groups:
            raise ValueError(f"groups={groups} does not divide the {width} channels of a GroupNorm layer")
    return lambda channels: nn.GroupNorm(groups, channels)


class _PadShortcut(nn.Module):
    """Option A: subsample by the stride and zero-pad the new channels evenly on both sides."""

    def __init__(self, stride: int, extra_channels: int) -> None:
        super().__init__()
        self.stride = stride
        self.pad = (extra_channels // 2, extra_channels - extra_channels // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, *self.pad))


class BasicBlock(nn.Module):
    """conv3x3 -> norm -> ReLU -> conv3x3 -> norm, plus the shortcut; `preact` stops before the last ReLU."""

    def __init__(self, in_channels: int, channels: int, stride: int, norm: Norm, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            if shortcut == "conv":
                self.downsample = nn.Sequential(
                    nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False), norm(channels)
                )
            else:
                self.downsample = _PadShortcut(stride, channels - in_channels)

    def preact(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return out + (x if self.downsample is None else self.downsample(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.preact(x))


class ResNet(FedModel):
    """A BasicBlock ResNet; build it through `resnet18`, `resnet34` or `resnet32`."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        *,
        blocks: Sequence[int],
        widths: Sequence[int],
        stem: str,
        norm: str,
        groups: int,
        head_bias: bool,
        shortcut: str,
    ) -> None:
        super().__init__()
        c, _, _ = image_shape(input_shape)
        self.num_classes = positive_int("num_classes", num_classes)
        head_bias = flag("head_bias", head_bias)
        norm_layer = _norm_layer(norm, groups, widths)
        if stem == "imagenet":
            self.conv1 = nn.Conv2d(c, widths[0], 7, stride=2, padding=3, bias=False)
            self.maxpool: nn.Module | None = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(c, widths[0], 3, stride=1, padding=1, bias=False)
            self.maxpool = None
        self.bn1 = norm_layer(widths[0])
        in_channels = widths[0]
        stages: list[str] = []
        for i, (n, width) in enumerate(zip(blocks, widths, strict=True)):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(
                *(
                    BasicBlock(in_channels if j == 0 else width, width, stride if j == 0 else 1, norm_layer, shortcut)
                    for j in range(n)
                )
            )
            self.add_module(f"layer{i + 1}", layer)
            stages.append(f"layer{i + 1}")
            in_channels = width
        self.stages = tuple(stages)
        self.fc = nn.Linear(in_channels, num_classes, bias=head_bias)
        self.feature_shape = (in_channels,)
        self.tap_names = ("layer0", *self.stages, "features")
        self.head_prefixes = ("fc",)

    def _extract(self, x: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        x = self.bn1(self.conv1(x))
        record(taps, "layer0", x)
        x = F.relu(x)
        if self.maxpool is not None:
            x = self.maxpool(x)
        for name in self.stages:
            for block in self.get_submodule(name):  # type: ignore[attr-defined]  # an nn.Sequential
                pre = block.preact(x)
                x = F.relu(pre)
            record(taps, name, pre)
        return x.mean(dim=(2, 3))

    def _classify(self, h: torch.Tensor, taps: Taps | None) -> torch.Tensor:
        return self.fc(h)


def _init_torchvision(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def _init_akamaster(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            nn.init.kaiming_normal_(m.weight)


def _resnet4(
    blocks: Sequence[int],
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: str,
    groups: int,
    stem: str,
    head_bias: bool,
    init: str,
) -> ResNet:
    stem = choice("stem", stem, ("cifar", "imagenet"))
    init = choice("init", init, ("code", "pytorch"))
    model = ResNet(
        input_shape,
        num_classes,
        blocks=blocks,
        widths=(64, 128, 256, 512),
        stem=stem,
        norm=norm,
        groups=groups,
        head_bias=head_bias,
        shortcut="conv",
    )
    if init == "code":
        _init_torchvision(model)
    return model


def resnet18(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: str = "bn",
    groups: int = 2,
    stem: str = "cifar",
    head_bias: bool = True,
    init: str = "code",
) -> ResNet:
    """ResNet-18: [2, 2, 2, 2] BasicBlocks, 64-512 channels; 11,173,962 parameters (CIFAR stem, 10 classes)."""
    return _resnet4(
        (2, 2, 2, 2), input_shape, num_classes, norm=norm, groups=groups, stem=stem, head_bias=head_bias, init=init
    )


def resnet34(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: str = "bn",
    groups: int = 2,
    stem: str = "cifar",
    head_bias: bool = True,
    init: str = "code",
) -> ResNet:
    """ResNet-34: [3, 4, 6, 3] BasicBlocks (FedSA's "CIFAR-100*" model, with ``stem="imagenet"``)."""
    return _resnet4(
        (3, 4, 6, 3), input_shape, num_classes, norm=norm, groups=groups, stem=stem, head_bias=head_bias, init=init
    )


def resnet32(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    norm: str = "bn",
    groups: int = 2,
    head_bias: bool = True,
    init: str = "code",
) -> ResNet:
    """The CIFAR ResNet-32 of FedVLS's code: 3 stages x 5 BasicBlocks, 16/32/64 channels, option-A shortcuts."""
    init = choice("init", init, ("code", "pytorch"))
    model = ResNet(
        input_shape,
        num_classes,
        blocks=(5, 5, 5),
        widths=(16, 32, 64),
        stem="cifar",
        norm=norm,
        groups=groups,
        head_bias=head_bias,
        shortcut="pad",
    )
    if init == "code":
        _init_akamaster(model)
    return model
