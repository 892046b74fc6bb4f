"""Bounds and choices of config fields, declared once on the field and checked here.

A config dataclass (`BusConfig`, `RoundPolicy`, `TrainSettings`, ...) writes a number's
range as ``Annotated[float, Bounds(gt=0, le=1)]`` and a choice as a ``Literal``; its `__post_init__`
calls `check_fields`. `experiments.config` derives the experiment file's sections from the same
fields, so that pydantic checks the same bounds when a file is loaded: each setting's type, default,
bounds and docstring are written only on its dataclass.

This module is the floor under every layer: it imports only the standard library, so the bus
(`broker`), the core (`fedcore`) and the daemons may all declare their settings with it without
importing one another (tests/test_boundaries.py).
"""

from __future__ import annotations

import functools
import operator
import types
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints


@dataclass(frozen=True, slots=True)
class Bounds:
    """Where a number must lie: every bound given holds (NaN is outside them all). pydantic's names."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    note: str = ""
    """Why, for the error message: "the MQTT limit"."""

    def limits(self) -> dict[str, float]:
        """The bounds given, as keywords of `pydantic.Field`."""
        return {name: getattr(self, name) for name in _TESTS if getattr(self, name) is not None}

    def allows(self, value: Any) -> bool:
        return all(_TESTS[name](value, bound) for name, bound in self.limits().items())

    def __str__(self) -> str:
        text = " and ".join(f"{_WORDS[name]} {bound}" for name, bound in self.limits().items())
        return f"{text} ({self.note})" if self.note else text


_TESTS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
_WORDS = {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}


class FieldError(ValueError):
    """A field outside its bounds or choices: which `field`, its `value` and what is `allowed` (in words)."""

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        super().__init__(f"{field} must be {allowed}, got {value!r}")
        self.field = field
        self.value = value
        self.allowed = allowed


@dataclass(frozen=True, slots=True)
class _Rule:
    name: str
    bounds: Bounds | None
    choices: tuple[Any, ...] | None
    optional: bool


def field_bounds(hint: Any) -> Bounds | None:
    """The `Bounds` of a field's type hint, written as ``Annotated[T, Bounds(...)]``; None without."""
    if get_origin(hint) is Annotated:
        return next((m for m in hint.__metadata__ if isinstance(m, Bounds)), None)
    return None


def unannotated(hint: Any) -> Any:
    """``T`` of ``Annotated[T, ...]``; any other hint as it is."""
    return get_args(hint)[0] if get_origin(hint) is Annotated else hint


@functools.cache
def _rules(cls: type) -> tuple[_Rule, ...]:
    hints = get_type_hints(cls, include_extras=True)
    rules = []
    for f in fields(cls):
        hint = hints[f.name]
        inner = unannotated(hint)
        members = get_args(inner) if get_origin(inner) in (Union, types.UnionType) else (inner,)
        optional = type(None) in members
        literal = [m for m in members if get_origin(m) is Literal]
        choices = tuple(c for m in literal for c in get_args(m)) if literal else None
        bounds = field_bounds(hint)
        if bounds is not None or choices is not None:
            rules.append(_Rule(f.name, bounds, choices, optional))
    return tuple(rules)


def check_fields(config: object) -> None:
    """Raise `FieldError` (a ValueError) naming the first field of the dataclass `config` outside its bounds
    or choices. A value the bounds cannot compare (a string for a number) raises TypeError."""
    kind: type = type(config)
    for rule in _rules(kind):
        value = getattr(config, rule.name)
        if value is None and rule.optional:
            continue
        if rule.choices is not None and value not in rule.choices:
            raise FieldError(rule.name, value, f"one of {', '.join(map(repr, rule.choices))}")
        if rule.bounds is not None and not rule.bounds.allows(value):
            raise FieldError(rule.name, value, str(rule.bounds))
