"""Models, built from a name in the config through `build_model`, so daemons never name one.

The interface (`FedModel`, in ``base.py``) that every model satisfies, so that algorithms use a
model without knowing it:
- ``extract(x) -> h``: the feature extractor; ``h`` has shape ``(B, *model.feature_shape)`` and
  is exactly what the head consumes (``model.feature_dim`` features per sample);
- ``classify(h) -> logits``: the head, ``(B, num_classes)``;
- ``forward(x) = classify(extract(x))``, bitwise;
- ``forward_taps(x) -> (logits, taps)``: the same logits and a dict of named ``(B, d)`` features
  in the order of ``model.tap_names`` (conv maps pooled, vectors flattened), ``"features"``
  (the flattened ``h``) always among them; ResNets and MobileNetV2 tap ``layer0`` ... ``layerN``
  as FedRCL does;
- ``represent(x) -> (z, logits)``: ``z`` is the tap ``model.representation_tap`` (MOON's
  projection for "moon-cnn", ``"features"`` elsewhere);
- ``head_keys()``: the state-dict keys of the head's parameters.

Registered models (name: options, defaults first):

| name | model | options |
|---|---|---|
| ``mlp`` | `MLP`: flatten, ReLU hidden layers, linear head | ``hidden`` (``[128]``) |
| ``dnn`` | FedVLS's MNIST DNN, 784 -> 200 -> 200 -> K | ``hidden`` (``[200, 200]``) |
| ``cnn`` | `SmallCNN`, the quickstart CNN | ``channels`` (``[16, 32]``), ``hidden`` (64) |
| ``moon-cnn`` | MOON/KDIA simple CNN with projection head, KDIA's conv/linear split | ``projection_dim`` (256) |
| ``fedavg-cnn`` | McMahan et al.'s CNN (1,663,370 parameters on MNIST) | none |
| ``conv2cifar`` | FedROD/FedNH CNN (797,952 parameters, CIFAR-10) | ``head_bias`` (false) |
| ``resnet18``, ``resnet34`` | BasicBlock ResNets | ``norm``, ``groups``, ``stem``, ``head_bias``, ``init`` |
| ``resnet32`` | FedVLS's CIFAR ResNet-32 | ``norm``, ``groups``, ``head_bias``, ``init`` |
| ``mobilenetv2`` | MobileNetV2 | ``variant`` (cifar, imagenet) |

ResNet options: ``norm`` bn | gn, ``groups`` (2, for gn), ``stem`` cifar | imagenet, ``head_bias``
(true), ``init`` code | pytorch; ``resnet.py`` explains each.

Where a paper and its code disagree on the architecture, the other form is an option:
``mobilenetv2`` ``variant`` defaults to the code's CIFAR network (fedvls.md A10). The ResNets'
``stem`` defaults to ``cifar`` (FedRCL, FedACD); FedSA and FedVLS ran torchvision's ImageNet stem
on 32x32 images, so their configs set ``stem: imagenet`` to reproduce them (fedvls.md A11,
fedsa.md 2). Initialisation follows each model's reference code: PyTorch's defaults, except the
ResNets' ``init: code`` (``resnet.py``).

`build_model` draws the initial weights from its own stream seeded by ``seed`` and leaves torch's
global generator untouched; an unknown model, an unknown option or a bad value is a
`ConfigError` that names the model.

A model of one's own: ``model.name: my_package.nets:MyNet`` (or a ``fedmq.models`` entry point), an
``nn.Module`` class or a function returning one, called as ``MyNet(input_shape, num_classes,
**model.options)``; its options are its keyword parameters after those two. FedAvg and the methods
that need only the logits train any such module; the ones that read features (MOON, KDIA, FedRCL,
FedNH, FedProto, ...) need a `FedModel`. `fedmq.testing.check_model` checks one.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Mapping

from torch import nn

from fedmq.fedcore import plugins
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models.base import FedModel
from fedmq.fedcore.models.cnn import Conv2Cifar, FedAvgCNN, MoonCNN
from fedmq.fedcore.models.mobilenet import MobileNetV2
from fedmq.fedcore.models.resnet import ResNet, resnet18, resnet32, resnet34
from fedmq.fedcore.models.small import MLP, SmallCNN, dnn
from fedmq.fedcore.seeding import global_stream

__all__ = [
    "MLP",
    "MODELS",
    "Conv2Cifar",
    "FedAvgCNN",
    "FedModel",
    "MobileNetV2",
    "MoonCNN",
    "ResNet",
    "SmallCNN",
    "build_model",
    "count_parameters",
    "model_options",
]

MODELS: Mapping[str, Callable[..., FedModel]] = types.MappingProxyType(
    {
        "mlp": MLP,
        "dnn": dnn,
        "cnn": SmallCNN,
        "moon-cnn": MoonCNN,
        "fedavg-cnn": FedAvgCNN,
        "conv2cifar": Conv2Cifar,
        "resnet18": resnet18,
        "resnet34": resnet34,
        "resnet32": resnet32,
        "mobilenetv2": MobileNetV2,
    }
)


_LOADED: dict[str, Callable[..., nn.Module]] = plugins.cache()
"""The user's models this process has resolved, by name."""


def _factory(name: str) -> Callable[..., nn.Module]:
    """Model `name`'s class or factory: built in, else a ``fedmq.models`` entry point or ``module:Name``."""
    if name in MODELS:
        return MODELS[name]
    if name not in _LOADED:
        found = plugins.resolve(name, "model", field="model.name", default_attr=None, builtins=list(MODELS))
        if not callable(found.value):
            raise ConfigError(
                f"{found.origin} is a {type(found.value).__name__}, not an nn.Module class or a function returning"
                " one (called as NAME(input_shape, num_classes, **model.options))",
                field="model.name",
            )
        try:
            inspect.signature(found.value)
        except (TypeError, ValueError):
            raise ConfigError(f"{found.origin}: its signature cannot be read", field="model.name") from None
        _LOADED[name] = found.value
    return _LOADED[name]


def model_options(name: str) -> dict[str, object]:
    """The options a model accepts, with their defaults."""
    params = list(inspect.signature(_factory(name)).parameters.values())[2:]  # after input_shape, num_classes
    return {p.name: p.default for p in params}


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, *, seed: int, **options: object
) -> nn.Module:
    """Model `name` for inputs of `input_shape` and `num_classes` classes, its weights drawn from `seed`.
    Every built-in model is a `FedModel`; a user's is any nn.Module (checked here)."""
    factory = _factory(name)
    allowed = model_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"model {name!r} has no option {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed) or 'none'}",
            field="model.options",
        )
    with global_stream(seed):
        try:
            model = factory(tuple(input_shape), num_classes, **options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model {name!r}: {exc}", field="model.options") from exc
        except Exception as exc:  # a user's model failed: say which, without a traceback
            if name in MODELS:
                raise
            message = f"model {name!r} raised {type(exc).__name__}: {exc}"
            raise ConfigError(message[:800], field="model.name") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model {name!r} gave a {type(model).__name__}, not a torch.nn.Module; make it an nn.Module subclass"
            " (or a function returning one) taking (input_shape, num_classes, **options)",
            field="model.name",
        )
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
