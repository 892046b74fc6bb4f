"""Staleness weights: how much an update trained from an older model version counts.

An update trained from version tau and folded into the model at version t has staleness
t - tau >= 0. Its weight is s(t - tau), with s(0) = 1 (a fresh update counts fully) and s
non-increasing. The functions here:

- ``constant``: s = 1 (no discount; synchronous FedAvg).
- ``polynomial``: s = (t - tau + 1)^-a, a > 0. Xie, Koyejo and Gupta, "Asynchronous Federated
  Optimization" (FedAsync), arXiv 2019, https://arxiv.org/abs/1903.03934: the mixing weight is
  alpha_t = alpha s(t - tau), with "s_a(t - tau) = (t - tau + 1)^-a".
- ``hinge``: s = 1 if t - tau <= b, else 1 / (a (t - tau - b) + 1), a > 0, b >= 0 (FedAsync's
  other choice: no discount up to b versions, then a hyperbolic one).
- ``sqrt``: s = 1 / sqrt(1 + t - tau). Nguyen et al., "Federated Learning with Buffered
  Asynchronous Aggregation" (FedBuff), AISTATS 2022, https://arxiv.org/abs/2106.06639, Algorithm
  1: each buffered delta is scaled by s(tau) = 1 / sqrt(1 + tau) before the buffer
  is averaged; FedScale's default too. It is the polynomial with a = 1/2, named for the paper.

The reference implementations disagree with one another: FedScale uses 1 / sqrt(1 + s) (FedBuff's,
kept here as "sqrt"), NVFlare's FedBuff example 1 / (1 + sqrt(s)), FedML's async aggregator
1 / (1 + s) (the polynomial with a = 1). Every one of them gives 1 at staleness 0, so a synchronous round,
where every update has staleness 0, is weighted exactly as without staleness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal, get_args

from fedmq.fields import Bounds, FieldError, check_fields

StalenessFunction = Literal["constant", "polynomial", "hinge", "sqrt"]
STALENESS_FUNCTIONS: tuple[str, ...] = get_args(StalenessFunction)


@dataclass(frozen=True, kw_only=True, slots=True)
class Staleness:
    """s(staleness), the weight of an update `staleness` versions old; s(0) = 1 for every function."""

    fn: StalenessFunction = "polynomial"
    """constant 1 | polynomial (1+tau)^-a | hinge (a, b) | sqrt 1/sqrt(1+tau)"""
    a: float = 0.5
    """polynomial's exponent; hinge's slope"""
    # positive where the function uses it, polynomial and hinge (FedAsync's experiments: 0.5, and 10 for the
    # hinge), which no Bounds can say: checked below. The experiment file asks a > 0 of every function.
    b: Annotated[float, Bounds(ge=0)] = 4.0
    """hinge: versions of staleness before the weight starts to fall"""
    # the hinge's free staleness, versions without discount (FedAsync: 4)

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"staleness {name} must be a finite number, got {value!r}")
        try:
            check_fields(self)
        except FieldError as exc:
            raise ValueError(f"staleness {exc}") from None
        if self.fn in ("polynomial", "hinge") and self.a <= 0:
            raise ValueError(f"staleness a must be positive for the {self.fn} function, got {self.a!r}")

    def __call__(self, staleness: int) -> float:
        """The weight of an update `staleness` (an int >= 0) versions old, in (0, 1]."""
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"staleness must be a non-negative int, got {staleness!r}")
        if staleness == 0 or self.fn == "constant":
            return 1.0  # exactly 1: a fresh update's weight is unchanged, bit for bit
        if self.fn == "polynomial":
            return float((staleness + 1) ** -self.a)  # (t - tau + 1)^-a
        if self.fn == "hinge":
            return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)
        return 1.0 / math.sqrt(1.0 + staleness)  # sqrt: 1 / sqrt(1 + tau)


CONSTANT = Staleness(fn="constant")
"""No discount: every update weighs 1, whatever its staleness."""
