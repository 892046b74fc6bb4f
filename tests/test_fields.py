"""Bounds and choices declared on config fields: checked on construction, each error naming its field."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest

from fedmq.fields import Bounds, FieldError, check_fields


@dataclass(frozen=True, kw_only=True, slots=True)
class _Settings:
    share: Annotated[float, Bounds(gt=0, le=1)] = 0.5
    count: Annotated[int | None, Bounds(ge=1, note="one at least")] = None
    mode: Literal["a", "b"] | None = "a"
    free: float = -1.0

    def __post_init__(self) -> None:
        check_fields(self)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"share": 0}, "share must be greater than 0 and at most 1, got 0"),
        ({"share": 1.5}, "share must be greater than 0 and at most 1, got 1.5"),
        ({"share": math.nan}, "share must be greater than 0 and at most 1, got nan"),
        ({"count": 0}, "count must be at least 1 (one at least), got 0"),
        ({"mode": "c"}, "mode must be one of 'a', 'b', got 'c'"),
    ],
)
def test_check_fields_value_outside_its_bounds_or_choices_names_the_field(
    change: dict[str, object], message: str
) -> None:
    """A value outside the declared range (NaN included) or not among the Literal's choices is refused."""
    with pytest.raises(FieldError) as info:
        _Settings(**change)  # type: ignore[arg-type]
    assert str(info.value) == message and isinstance(info.value, ValueError)
    assert info.value.field in change and message.startswith(f"{info.value.field} must be {info.value.allowed},")


def test_check_fields_bounds_edges_none_and_undeclared_fields_pass() -> None:
    """Inclusive bounds admit their edge, None passes where the type allows it, a field without bounds is free."""
    settings = _Settings(share=1, count=1, mode=None, free=-math.inf)
    assert (settings.share, settings.count, settings.mode) == (1, 1, None)
    assert _Settings(count=None).count is None


def test_bounds_limits_are_pydantic_field_keywords() -> None:
    """What `experiments.config` hands to pydantic.Field: only the bounds given, by pydantic's names."""
    assert Bounds(gt=0, le=1, note="x").limits() == {"gt": 0, "le": 1}
    assert Bounds().limits() == {} and Bounds().allows(math.nan)
