"""Robust aggregation: rules for ``method.aggregator`` that bound what one poisoned update can do.

Each is an `Aggregator` (``(client models, weights) -> model``) that replaces the weighted mean of
any method whose server averages models (`CoordinatorHalf.average`); nodes train as before.

- ``clip``: norm clipping. Sun, Kairouz, Suresh and McMahan, "Can You Really Backdoor Federated
  Learning?", arXiv 1911.07963 (2019), section 3: each update's delta from the global model,
  d_k = w_k - w, is scaled to L2 norm at most M, and the server adds their weighted mean:

      w' = w + sum_k p_k min(1, M / ||d_k||) d_k

  The norm runs over every floating entry of the state (buffers such as BatchNorm's running
  statistics too, so none of them is a way around the bound). Then ||w' - w|| <= M whatever the
  updates are, and node k moves the model by at most p_k M: M / K with ``weighted: false``. With
  ``weighted: true`` (the default) p_k is the method's own weight, usually the sample count a node
  reports about itself, so a node that claims many samples pulls harder (still at most M).
  With no update clipped the result is the weighted mean up to float rounding.
- ``median``: the coordinate-wise median, and ``trimmed_mean``: the coordinate-wise beta-trimmed
  mean. Yin, Chen, Ramchandran and Bartlett, "Byzantine-Robust Distributed Learning: Towards
  Optimal Statistical Rates", ICML 2018, https://arxiv.org/abs/1803.01498, Definitions 1 and 2.
  For every coordinate the K values are sorted; the median is the middle one (the mean of the two
  middle ones when K is even), the trimmed mean drops the floor(beta K) smallest and largest and
  averages the rest. Both are unweighted, as in the paper: every update with a positive weight
  counts once, whatever its sample count (a weight of zero, a method's way to leave an update out,
  leaves it out). With fewer than 1 / beta updates the trimmed mean trims nothing: the plain mean.

Integer entries (BatchNorm's ``num_batches_tracked``) take the maximum over the counted updates,
as in `mean.weighted_average`. Floating entries are computed in float32 (float64 for float64 tensors).
Median and trimmed mean do not depend on the order of the updates, bit for bit (the values are
sorted, with -0.0 read as 0.0); clip sums in the given order, which the coordinator fixes (by node
id). None of them folds stale updates: async mode refuses them (`fedcore.algorithms.async_refusal`).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fedmq.fedcore.tensors import StateDict


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipOptions:
    max_norm: float | Literal["auto"]
    """M, the largest L2 norm (over all floating entries) an update's delta from the global model
    keeps; required, positive. Pick it from the ``clip_norm_median`` the rule logs each round, or
    "auto": `auto_multiple` times the median of the round's own delta norms, so that no update pulls
    harder than a few typical ones while fewer than half of a round's updates are hostile (the
    default rule of ``fedmq run --secure``)."""
    weighted: bool = True
    """Weight the clipped deltas by the method's weights (sample counts); false: 1 / K each, so one
    node moves the model by at most M / K."""
    auto_multiple: float = 3.0
    """With max_norm "auto": M is this many times the round's median delta norm (at least 1). At 3, an
    honest round, whose norms are of one size, is clipped rarely (then it is the weighted mean)."""

    def __post_init__(self) -> None:
        if self.max_norm != "auto" and not (
            isinstance(self.max_norm, int | float)
            and not isinstance(self.max_norm, bool)
            and math.isfinite(self.max_norm)
            and self.max_norm > 0
        ):
            raise ValueError(f"max_norm must be a positive number or 'auto', got {self.max_norm!r}")
        if not (isinstance(self.auto_multiple, int | float) and 1 <= self.auto_multiple < math.inf):
            raise ValueError(f"auto_multiple must be a number of at least 1, got {self.auto_multiple!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrimmedMeanOptions:
    trim: float = 0.1
    """beta, the share of values dropped at each end of every coordinate, in [0, 0.5): floor(beta K)
    each side (0.1 drops one of ten at each end; 0 is the unweighted mean)."""

    def __post_init__(self) -> None:
        if not (isinstance(self.trim, int | float) and 0.0 <= self.trim < 0.5):
            raise ValueError(f"trim must be in [0, 0.5), got {self.trim!r}")


def trimmed_per_side(trim: float, updates: int) -> int:
    """floor(trim K): how many values the trimmed mean drops at each end of a coordinate."""
    return math.floor(trim * updates + 1e-9)  # 0.29 * 100 is 28.999...: still 29


def ineffective(rule: str, options: Mapping[str, Any], updates: int) -> str | None:
    """Why `rule` with `options` would be the plain mean over `updates` updates a round (None: it
    is not): a robust rule that protects nothing for the configured cohort is refused at load, with
    the arithmetic, rather than trusted (issue 31: trim 0.1 over 5 updates trimmed nothing)."""
    if rule == "trimmed_mean":
        trim = float(options.get("trim", TrimmedMeanOptions().trim))
        if trimmed_per_side(trim, updates) >= 1:
            return None
        if updates < 3:
            return f"trimmed_mean over {updates} update(s) a round can trim nothing (trim stays below 0.5)"
        return (
            f"trimmed_mean with trim {trim:g} over {updates} updates a round drops floor({trim:g} x {updates}) = 0"
            f" values at each end: it is the plain mean; set trim to at least {1 / updates:.3g} (1/{updates})"
        )
    if rule == "median" and updates <= 2:
        return f"median over {updates} update(s) a round is their mean"
    if rule == "clip" and options.get("max_norm") == "auto" and updates <= 2:
        return (
            f"clip with max_norm auto over {updates} update(s) a round: the median norm it bounds them by"
            " is pulled by the very update it should bound (3 or more updates a round)"
        )
    return None


def clipped_mean(
    current: StateDict,
    states: Sequence[StateDict],
    weights: Sequence[float],
    *,
    max_norm: float | Callable[[list[float]], float],
    weighted: bool = True,
    norms: list[float] | None = None,
) -> StateDict:
    """``w + sum_k p_k min(1, max_norm / ||w_k - w||) (w_k - w)`` with w = `current` (module docstring);
    `max_norm` may be a function of the counted updates' norms (max_norm "auto"); those norms, before
    clipping, are appended to `norms` when given."""
    kept = _counted(states, weights)
    for k in kept:
        if states[k].keys() != current.keys():
            missing, extra = sorted(current.keys() - states[k].keys()), sorted(states[k].keys() - current.keys())
            raise ValueError(
                "clip needs every averaged entry in the global model (FedNH's learnt scale is not): "
                f"missing {missing[:5]}, unexpected {extra[:5]}"
            )
    total = math.fsum(float(weights[k]) for k in kept)
    share = {k: float(weights[k]) / total if weighted else 1.0 / len(kept) for k in kept}
    norm = {k: update_norm(current, states[k]) for k in kept}
    if norms is not None:
        norms.extend(norm.values())
    bound = max_norm(list(norm.values())) if callable(max_norm) else max_norm
    coefficient = {k: share[k] * min(1.0, bound / norm[k]) if norm[k] > 0 else share[k] for k in kept}
    out: StateDict = {}
    for name, now in current.items():
        if not now.is_floating_point():
            out[name] = torch.stack([states[k][name] for k in kept]).amax(0)
            continue
        w = now.to(_wide(now), copy=True)
        step = torch.zeros_like(w)
        for k in kept:
            step.add_(states[k][name].to(w.dtype) - w, alpha=coefficient[k])  # p_k min(1, M / ||d_k||) d_k
        out[name] = w.add_(step).to(now.dtype)
    return out


def update_norm(current: StateDict, state: StateDict) -> float:
    """||state - current|| in L2 over all floating entries, summed in float64 in key order."""
    total = 0.0
    for name, now in current.items():
        if now.is_floating_point():
            total += float((state[name].double() - now.double()).square().sum())
    return math.sqrt(total)


class NormClip:
    """`clipped_mean` against the global `model` as it is at each call (methods load the next model
    into it in place after averaging, so it always holds the model the nodes started from); keeps
    its last call's `metrics`."""

    def __init__(self, hp: ClipOptions, *, model: nn.Module | None = None) -> None:
        self.hp = hp
        self.model = model
        self.norms: list[float] = []
        """The counted updates' delta norms in the last call, before clipping."""
        self.bound = math.inf
        """M in the last call (with max_norm "auto", the round's own)."""

    def __call__(self, states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
        if self.model is None:
            raise ValueError("the clip aggregator needs the global model to clip against (build it with model=...)")
        self.norms = []
        current = self.model.state_dict()
        return clipped_mean(current, states, weights, max_norm=self._bound, weighted=self.hp.weighted, norms=self.norms)

    def _bound(self, norms: list[float]) -> float:
        """M for a round whose updates' delta norms are `norms`: the configured one, or "auto"'s."""
        max_norm = self.hp.max_norm
        if max_norm == "auto":
            median = statistics.median(norms) if norms else 0.0
            self.bound = self.hp.auto_multiple * median if median > 0 else math.inf
        else:
            self.bound = max_norm
        return self.bound

    @property
    def metrics(self) -> dict[str, float]:
        """The last call's share of clipped updates and the median and largest delta norm (before clipping)."""
        if not self.norms:
            return {}
        return {
            "clip_share": sum(n > self.bound for n in self.norms) / len(self.norms),
            "clip_norm_median": statistics.median(self.norms),
            "clip_norm_max": max(self.norms),
        } | ({"clip_max_norm": self.bound} if self.hp.max_norm == "auto" else {})


def coordinate_median(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """Per coordinate, the middle of the counted updates' sorted values (mean of the two middle ones
    for an even count); unweighted (Yin et al. 2018, Definition 1)."""

    def middle(values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        if n % 2:
            return values[n // 2]
        return values[n // 2 - 1] / 2 + values[n // 2] / 2  # halves first: no overflow

    return _order_statistic(states, weights, middle)


def trimmed_mean(states: Sequence[StateDict], weights: Sequence[float], *, trim: float = 0.1) -> StateDict:
    """Per coordinate, the mean of the counted updates' sorted values without the floor(trim K)
    smallest and largest; unweighted (Yin et al. 2018, Definition 2)."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim!r}")

    def kept_mean(values: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        cut = trimmed_per_side(trim, n)
        return values[cut : n - cut].sum(0) / (n - 2 * cut)

    return _order_statistic(states, weights, kept_mean)


def trimmed_mean_aggregator(hp: TrimmedMeanOptions) -> Callable[[Sequence[StateDict], Sequence[float]], StateDict]:
    return functools.partial(trimmed_mean, trim=hp.trim)


def _order_statistic(
    states: Sequence[StateDict], weights: Sequence[float], reduce: Callable[[torch.Tensor], torch.Tensor]
) -> StateDict:
    """`reduce` over dimension 0 of each floating entry's counted values, sorted per coordinate."""
    kept = [states[k] for k in _counted(states, weights)]
    out: StateDict = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            out[name] = torch.stack([s[name] for s in kept]).amax(0)
            continue
        values = torch.stack([s[name].to(_wide(first)) for s in kept]).add_(0.0)  # -0.0 + 0.0 = 0.0
        out[name] = reduce(values.sort(dim=0).values).to(first.dtype)
    return out


def _counted(states: Sequence[StateDict], weights: Sequence[float]) -> list[int]:
    """Indices of the updates with a positive weight; ValueError on bad weights or none counted."""
    if not states or len(states) != len(weights):
        raise ValueError("a robust aggregator needs as many weights as states, and at least one")
    if not all(math.isfinite(float(w)) and float(w) >= 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    kept = [k for k, w in enumerate(weights) if float(w) > 0]
    if not kept:
        raise ValueError("weights must sum to a positive number")
    return kept


def _wide(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32
