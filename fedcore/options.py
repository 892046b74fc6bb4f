"""A config's mapping made into a frozen options dataclass, with errors that name the field.

A method's hyperparameters (`fedcore.algorithms.build_hyperparams`) and an averaging rule's options
(`fedcore.aggregation.build_aggregator`) are read the same way; this sits under both so that
neither layer imports the other for it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from fedmq.fedcore.errors import ConfigError


def parse_options(
    cls: type, owner: str, values: Mapping[str, Any] | None, where: str, noun: str = "hyperparameters"
) -> Any:
    """`cls` (a frozen options dataclass) from a mapping from outside: unknown keys, wrong types and
    values its __post_init__ rejects are ConfigErrors naming the field (`where`, e.g.
    ``method.hyperparams``) and, for unknown keys, `owner` and what it allows."""
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
