"""The algorithm registry: configs name an algorithm, daemons resolve it here and use only `base`.

`ALGORITHMS` holds the built-in methods; `get_algorithm` also finds a user's own (a module holding
``SPEC``, or a ``fedmq.methods`` entry point: `fedcore.algorithms.plugins`)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

from fedmq.fedcore import aggregation
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
from fedmq.fedcore.options import parse_options

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
    Unknown names are ConfigErrors, as in `get_algorithm` and `aggregation.build_aggregator`."""
    reason = get_algorithm(name).coordinator.sync_only
    if reason is not None:
        return f"method {name!r} cannot aggregate asynchronously: {reason}"
    return aggregation.async_refusal(aggregator)


def build_hyperparams(spec: AlgorithmSpec, values: Mapping[str, Any] | None) -> Any:
    """The algorithm's frozen Hyperparams from a mapping; unknown keys and wrong types are errors."""
    return parse_options(spec.hyperparams, spec.name, values, "method.hyperparams")
