"""The algorithm registry: configs name an algorithm, daemons resolve it here and use only `base`.

`ALGORITHMS` holds the built-in methods; `get_algorithm` also finds a user's own (a module holding
``SPEC``, or a ``fedmq.methods`` entry point: `fedcore.algorithms.plugins`)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedmq.fedcore.aggregation import Aggregator, robust, skew_aware, weighted_average
from fedmq.fedcore.algorithms import (
    fedacd,
    fedavg,
    fedavgm,
    feddecorr,
    feddisco,
    feddyn,
    fedgkd,
    fedlc,
    fednh,
    fedntd,
    fedproto,
    fedprox,
    fedrcl,
    fedrs,
    fedsa,
    fedvls,
    kdia,
    moon,
    noop,
    scaffold,
)
from fedmq.fedcore.algorithms.base import AlgorithmSpec
from fedmq.fedcore.algorithms.plugins import load_method
from fedmq.fedcore.errors import ConfigError

ALGORITHMS: Mapping[str, AlgorithmSpec] = types.MappingProxyType(
    {
        spec.name: spec
        for spec in (
            fedavg.SPEC,
            fedavgm.SPEC,
            fedprox.SPEC,
            moon.SPEC,
            fedgkd.SPEC,
            feddisco.SPEC,
            kdia.SPEC,
            scaffold.SPEC,
            feddyn.SPEC,
            fedlc.SPEC,
            fedrs.SPEC,
            fedvls.SPEC,
            fedacd.SPEC,
            fedntd.SPEC,
            feddecorr.SPEC,
            fednh.SPEC,
            fedproto.SPEC,
            fedrcl.SPEC,
            fedsa.SPEC,
            noop.SPEC,
        )
    }
)


AggregatorFactory = Callable[[Any, nn.Module | None, torch.device | None], Aggregator]

AGGREGATORS: Mapping[str, tuple[type | None, AggregatorFactory]] = types.MappingProxyType(
    {
        "mean": (None, lambda hp, model, device: weighted_average),
        "fedsa": (fedsa.Hyperparams, lambda hp, model, device: skew_aware.aggregator(hp, model=model, device=device)),
        "clip": (robust.ClipOptions, lambda hp, model, device: robust.NormClip(hp, model=model)),
        "median": (None, lambda hp, model, device: robust.coordinate_median),
        "trimmed_mean": (robust.TrimmedMeanOptions, lambda hp, model, device: robust.trimmed_mean_aggregator(hp)),
    }
)
"""Rules an experiment file may put in place of a method's model averaging (``method.aggregator``):
name -> (its options' Hyperparams class, or None for no options; a factory from (options, the
global model, the coordinator's device)). `fedcore.aggregation.robust` documents clip, median and trimmed_mean."""

_ONLY = "an asynchronous buffer folds stale updates with the 'mean' aggregator only"
_SYNC_ONLY = {
    "fedsa": f"it computes statistics over one round's client models, and {_ONLY}",
    "clip": "it clips each update's delta from the current model, while asynchronous folding steps from the "
    f"model each update started from; {_ONLY}",
    "median": f"it is an unweighted order statistic of one round's client models, blind to staleness; {_ONLY}",
    "trimmed_mean": f"it is an unweighted order statistic of one round's client models, blind to staleness; {_ONLY}",
}
"""Why each rule but the mean cannot fold stale updates (`async_refusal`)."""


def build_aggregator(
    name: str,
    options: Mapping[str, Any] | None = None,
    *,
    model: nn.Module | None = None,
    device: torch.device | None = None,
) -> Aggregator:
    """The averaging rule `name` with its `options` validated as a method's hyperparameters are; `model`
    tells a rule which entries are buffers (FedSA averages those plainly)."""
    try:
        hyperparams, factory = AGGREGATORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown aggregator {name!r}; available: {', '.join(sorted(AGGREGATORS))}", field="method.aggregator.name"
        ) from None
    if hyperparams is None:
        if options:
            raise ConfigError(f"aggregator {name!r} takes no options", field="method.aggregator.options")
        return factory(None, model, device)
    hp = _options(hyperparams, f"aggregator {name}", options, "method.aggregator.options", "options")
    return factory(hp, model, device)


def get_algorithm(name: str) -> AlgorithmSpec:
    """The method `name`: a built-in one, else a user's (`plugins.load_method`: a ``fedmq.methods`` entry
    point or a module holding SPEC). ConfigError says what was tried."""
    spec = ALGORITHMS.get(name)
    return spec if spec is not None else load_method(name, ALGORITHMS)


def async_refusal(name: str, aggregator: str = "mean") -> str | None:
    """Why method `name` with averaging rule `aggregator` cannot run in async mode (a sentence for a
    config error), or None when it can: the method's `CoordinatorHalf.sync_only`, then the rule (a
    stale buffer folds through the weighted mean only; FedSA's rule and the robust ones need one
    round's cohort).
    Unknown names are ConfigErrors, as in `get_algorithm` and `build_aggregator`."""
    reason = get_algorithm(name).coordinator.sync_only
    if reason is not None:
        return f"method {name!r} cannot aggregate asynchronously: {reason}"
    if aggregator not in AGGREGATORS:
        raise ConfigError(
            f"unknown aggregator {aggregator!r}; available: {', '.join(sorted(AGGREGATORS))}",
            field="method.aggregator.name",
        )
    if aggregator != "mean":
        reason = _SYNC_ONLY.get(aggregator, f"it is not the mean, and {_ONLY}")
        return f"aggregator {aggregator!r} cannot aggregate asynchronously: {reason}"
    return None


def build_hyperparams(spec: AlgorithmSpec, values: Mapping[str, Any] | None) -> Any:
    """The algorithm's frozen Hyperparams from a mapping; unknown keys and wrong types are errors."""
    return _options(spec.hyperparams, spec.name, values, "method.hyperparams")


def _options(cls: type, owner: str, values: Mapping[str, Any] | None, where: str, noun: str = "hyperparameters") -> Any:
    """`cls` (a frozen options dataclass) from a mapping from outside: unknown keys, wrong types and
    values its __post_init__ rejects are ConfigErrors naming the field."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown {noun} {unknown} for {owner}; allowed: {sorted(fields) or 'none'}",
            field=where,
        )
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        expected = hints[name]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif expected in (int, float, bool, str) and (
            not isinstance(value, expected) or (expected is not bool and isinstance(value, bool))
        ):
            raise ConfigError(f"{value!r} is not a {expected.__name__}", field=f"{where}.{name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc), field=where) from exc
