"""The algorithm registry: configs name an algorithm, daemons resolve it here and use only `base`."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from fedcore.algorithms import fedavg, fedavgm, feddisco, fedgkd, fedprox, kdia, moon
from fedcore.algorithms.base import AlgorithmSpec
from fedcore.errors import ConfigError

ALGORITHMS: Mapping[str, AlgorithmSpec] = types.MappingProxyType(
    {
        spec.name: spec
        for spec in (fedavg.SPEC, fedavgm.SPEC, fedprox.SPEC, moon.SPEC, fedgkd.SPEC, feddisco.SPEC, kdia.SPEC)
    }
)


def get_algorithm(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(
            f"unknown method {name!r}; available: {', '.join(sorted(ALGORITHMS))}", field="method.name"
        ) from None


def build_hyperparams(spec: AlgorithmSpec, values: Mapping[str, Any] | None) -> Any:
    """The algorithm's frozen Hyperparams from a mapping; unknown keys and wrong types are errors."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(spec.hyperparams)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown hyperparameters {unknown} for {spec.name}; allowed: {sorted(fields) or 'none'}",
            field="method.hyperparams",
        )
    hints = typing.get_type_hints(spec.hyperparams)
    for name, value in values.items():
        expected = hints[name]
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            values[name] = float(value)
        elif expected in (int, float, bool, str) and (
            not isinstance(value, expected) or (expected is not bool and isinstance(value, bool))
        ):
            raise ConfigError(f"{value!r} is not a {expected.__name__}", field=f"method.hyperparams.{name}")
    try:
        return spec.hyperparams(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc), field="method.hyperparams") from exc
