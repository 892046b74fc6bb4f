"""Aggregation: every rule that turns client models into one, and the registry that names them.

`mean` holds the weighted mean (every averaging method's default) and the asynchronous folding
steps; `robust` the rules that bound a poisoned update; `skew_aware` FedSA's skew-aware rule. An
experiment file names a rule in ``method.aggregator`` and `build_aggregator` makes it; the rest of
fedmq imports the names below, so a module that only averages need not know which file a rule
lives in. The registry sits here, under the methods (`fedcore.algorithms`), so that a rule never
depends on a method.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedmq.fedcore.aggregation import robust, skew_aware
from fedmq.fedcore.aggregation.mean import Aggregator, fedasync_step, fedbuff_step, weighted_average
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.options import parse_options

__all__ = [
    "AGGREGATORS",
    "Aggregator",
    "AggregatorFactory",
    "async_refusal",
    "build_aggregator",
    "fedasync_step",
    "fedbuff_step",
    "rule",
    "weighted_average",
]

AggregatorFactory = Callable[[Any, nn.Module | None, torch.device | None], Aggregator]

AGGREGATORS: Mapping[str, tuple[type | None, AggregatorFactory]] = types.MappingProxyType(
    {
        "mean": (None, lambda hp, model, device: weighted_average),
        "fedsa": (
            skew_aware.SkewAwareOptions,
            lambda hp, model, device: skew_aware.aggregator(hp, model=model, device=device),
        ),
        "clip": (robust.ClipOptions, lambda hp, model, device: robust.NormClip(hp, model=model)),
        "median": (None, lambda hp, model, device: robust.coordinate_median),
        "trimmed_mean": (robust.TrimmedMeanOptions, lambda hp, model, device: robust.trimmed_mean_aggregator(hp)),
    }
)
"""Rules an experiment file may put in place of a method's model averaging (``method.aggregator``):
name -> (its options' dataclass, or None for no options; a factory from (options, the global
model, the coordinator's device)). `robust` documents clip, median and trimmed_mean, `skew_aware`
fedsa (the FedSA method's rule, whose method-only ``log_layers`` is not a rule option)."""

_ONLY = "an asynchronous buffer folds stale updates with the 'mean' aggregator only"
_SYNC_ONLY = {
    "fedsa": f"it computes statistics over one round's client models, and {_ONLY}",
    "clip": "it clips each update's delta from the current model, while asynchronous folding steps from the "
    f"model each update started from; {_ONLY}",
    "median": f"it is an unweighted order statistic of one round's client models, blind to staleness; {_ONLY}",
    "trimmed_mean": f"it is an unweighted order statistic of one round's client models, blind to staleness; {_ONLY}",
}
"""Why each rule but the mean cannot fold stale updates (`async_refusal`)."""


def rule(name: str) -> tuple[type | None, AggregatorFactory]:
    """The registry's entry for `name`: (its options' dataclass or None, its factory). An unknown
    name is a ConfigError on ``method.aggregator.name`` that lists the known ones, so a typo in an
    experiment file says what it could have been."""
    try:
        return AGGREGATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown aggregator {name!r}; available: {', '.join(sorted(AGGREGATORS))}", field="method.aggregator.name"
        ) from None


def build_aggregator(
    name: str,
    options: Mapping[str, Any] | None = None,
    *,
    model: nn.Module | None = None,
    device: torch.device | None = None,
) -> Aggregator:
    """The averaging rule `name` with its `options` validated as a method's hyperparameters are; `model`
    tells a rule which entries are buffers (FedSA averages those plainly)."""
    hyperparams, factory = rule(name)
    if hyperparams is None:
        if options:
            raise ConfigError(f"aggregator {name!r} takes no options", field="method.aggregator.options")
        return factory(None, model, device)
    hp = parse_options(hyperparams, f"aggregator {name}", options, "method.aggregator.options", "options")
    return factory(hp, model, device)


def async_refusal(name: str) -> str | None:
    """Why rule `name` cannot fold stale updates in async mode (a sentence for a config error), or
    None for the mean; an unknown name is `rule`'s ConfigError. A method's own refusal comes first:
    `fedcore.algorithms.async_refusal`."""
    rule(name)
    if name == "mean":
        return None
    reason = _SYNC_ONLY.get(name, f"it is not the mean, and {_ONLY}")
    return f"aggregator {name!r} cannot aggregate asynchronously: {reason}"
