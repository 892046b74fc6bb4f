"""Staleness functions: hand-computed values, s(0) = 1, monotonicity and validation."""

from __future__ import annotations

import itertools
import math

import pytest

from fedmq.fedcore.staleness import CONSTANT, STALENESS_FUNCTIONS, Staleness


@pytest.mark.parametrize(
    ("staleness", "t", "expected"),
    [
        (Staleness(fn="polynomial", a=0.5), 3, 0.5),  # (3 + 1)^-0.5
        (Staleness(fn="polynomial", a=1.0), 4, 0.2),  # (4 + 1)^-1
        (Staleness(fn="polynomial", a=2.0), 1, 0.25),  # (1 + 1)^-2
        (Staleness(fn="hinge", a=10.0, b=4.0), 4, 1.0),  # t <= b: no discount
        (Staleness(fn="hinge", a=10.0, b=4.0), 6, 1 / 21),  # 1 / (10 (6 - 4) + 1)
        (Staleness(fn="hinge", a=0.5, b=0.0), 2, 0.5),  # 1 / (0.5 x 2 + 1)
        (Staleness(fn="sqrt"), 3, 0.5),  # 1 / sqrt(1 + 3)
        (Staleness(fn="sqrt"), 8, 1 / 3),  # 1 / sqrt(9)
        (CONSTANT, 100, 1.0),
    ],
)
def test_staleness_value_matches_hand_computed(staleness: Staleness, t: int, expected: float) -> None:
    """Each function's weight at a given staleness is the hand-computed one."""
    assert staleness(t) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("fn", STALENESS_FUNCTIONS)
def test_staleness_fresh_update_weighs_exactly_one(fn: str) -> None:
    """s(0) is exactly 1.0 for every function and parameters, so a sync round's weights are unchanged."""
    for a, b in [(0.5, 4.0), (3.0, 0.0), (1e-3, 100.0)]:
        assert Staleness(fn=fn, a=a, b=b)(0) == 1.0


@pytest.mark.parametrize("fn", STALENESS_FUNCTIONS)
def test_staleness_weights_are_non_increasing_in_staleness(fn: str) -> None:
    """s(t + 1) <= s(t) and 0 < s(t) <= 1 over the first 200 versions; all but constant strictly decay at last."""
    s = Staleness(fn=fn, a=0.7, b=3.0)
    values = [s(t) for t in range(200)]
    assert all(0 < v <= 1 for v in values)
    assert all(later <= earlier for earlier, later in itertools.pairwise(values))
    assert (values[-1] < 1.0) == (fn != "constant")


def test_staleness_sqrt_equals_polynomial_with_half_exponent() -> None:
    """FedBuff's 1 / sqrt(1 + t) is the polynomial (1 + t)^-1/2 (to rounding)."""
    for t in range(50):
        assert Staleness(fn="sqrt")(t) == pytest.approx(Staleness(fn="polynomial", a=0.5)(t), rel=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fn": "exponential"}, "must be one of .*constant.*polynomial.*hinge.*sqrt"),
        ({"fn": "polynomial", "a": 0.0}, "a must be positive for the polynomial"),
        ({"fn": "hinge", "a": -1.0}, "a must be positive for the hinge"),
        ({"fn": "hinge", "b": -0.5}, "b must be at least 0"),
        ({"fn": "polynomial", "a": math.nan}, "a must be a finite number"),
        ({"fn": "hinge", "b": math.inf}, "b must be a finite number"),
        ({"fn": "sqrt", "a": True}, "a must be a finite number"),
    ],
)
def test_staleness_bad_parameters_raise_value_error(kwargs: dict[str, object], match: str) -> None:
    """Unknown functions (the message lists the allowed ones), non-positive a, negative b, non-finite numbers."""
    with pytest.raises(ValueError, match=match):
        Staleness(**kwargs)  # type: ignore[arg-type]


def test_staleness_parameters_irrelevant_to_the_function_are_not_checked_for_sign() -> None:
    """a only matters to polynomial and hinge: constant and sqrt accept a = 0."""
    assert Staleness(fn="constant", a=0.0)(5) == 1.0
    assert Staleness(fn="sqrt", a=0.0)(3) == 0.5


@pytest.mark.parametrize("bad", [-1, 1.0, 2.5, True, "3", None])
def test_staleness_call_with_negative_or_non_int_raises_value_error(bad: object) -> None:
    """Staleness is a non-negative int: negatives, floats, bools and anything else are refused."""
    with pytest.raises(ValueError, match="non-negative int"):
        Staleness()(bad)  # type: ignore[arg-type]
