"""The weighted mean every averaging method uses by default, and the two asynchronous folding
rules (FedAsync's mixing step, FedBuff's buffered delta step) that `CoordinatorHalf.next_model`
dispatches to: the only rules that fold stale updates, so they live apart from the sync-only ones."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from fedmq.fedcore.tensors import StateDict

Aggregator = Callable[[Sequence[StateDict], Sequence[float]], StateDict]
"""(client models, their weights) -> one model: the step ``method.aggregator`` replaces in any averaging method."""


def weighted_average(states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
    """Weighted mean of floating tensors, in the given order (so the sum is reproducible).

    Integer buffers such as BatchNorm's ``num_batches_tracked`` cannot be averaged; they take the
    maximum over the inputs.
    """
    if not states or len(states) != len(weights):
        raise ValueError("weighted_average needs as many weights as states, and at least one")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    out: StateDict = {}
    for name, first in states[0].items():
        if first.is_floating_point():
            acc = torch.zeros_like(first, dtype=torch.float32 if first.dtype != torch.float64 else torch.float64)
            for state, weight in zip(states, weights, strict=True):
                acc.add_(state[name].to(acc.dtype), alpha=float(weight) / total)
            out[name] = acc.to(first.dtype)
        else:
            out[name] = torch.stack([s[name] for s in states]).amax(0)
    return out


def fedasync_step(
    current: StateDict,
    states: Sequence[StateDict],
    weights: Sequence[float],
    discounts: Sequence[float],
    *,
    server_lr: float = 1.0,
) -> StateDict:
    """``w + server_lr sum_k p_k s_k (w_k - w)`` with p_k = weights_k / sum_j weights_j, s_k = discounts_k.

    Xie et al. (FedAsync, arXiv 1903.03934): with one update, ``w <- (1 - alpha_t) w + alpha_t w_new``,
    alpha_t = server_lr s(t - tau). Every update is mixed against the current model `current`.
    Floating entries accumulate in float32 (float64 for float64 tensors); integer buffers take the
    maximum over the updates, as in `weighted_average`.
    """
    return _delta_step(current, states, [current] * len(states), weights, discounts, server_lr)


def fedbuff_step(
    current: StateDict,
    states: Sequence[StateDict],
    bases: Sequence[StateDict],
    weights: Sequence[float],
    discounts: Sequence[float],
    *,
    server_lr: float = 1.0,
) -> StateDict:
    """``w + server_lr sum_k p_k s_k (w_k - b_k)``: each update's delta from the model it trained from.

    Nguyen et al. (FedBuff, arXiv 2106.06639, Algorithm 1): with p_k = 1/K it is the buffer's sum of
    s(tau_k) Delta_k divided by K, applied with the server learning rate eta_g. `bases[k]` is the
    model update k was trained from. Floating entries accumulate in float32 (float64 for float64
    tensors); integer buffers take the maximum over the updates.
    """
    return _delta_step(current, states, bases, weights, discounts, server_lr)


def _delta_step(
    current: StateDict,
    states: Sequence[StateDict],
    bases: Sequence[StateDict],
    weights: Sequence[float],
    discounts: Sequence[float],
    server_lr: float,
) -> StateDict:
    if not states or not len(states) == len(bases) == len(weights) == len(discounts):
        raise ValueError("a folding step needs one base, weight and discount per state, and at least one state")
    if not all(math.isfinite(float(w)) and float(w) >= 0 for w in weights):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    if not all(math.isfinite(float(d)) and float(d) >= 0 for d in discounts):
        raise ValueError(f"staleness discounts must be finite and non-negative, got {list(discounts)}")
    if not (math.isfinite(server_lr) and server_lr > 0):
        raise ValueError(f"server_lr must be a positive number, got {server_lr!r}")
    total = math.fsum(float(w) for w in weights)
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    coefficients = [float(w) / total * float(d) for w, d in zip(weights, discounts, strict=True)]
    for state in (*states, *bases):
        if state.keys() != current.keys():
            missing, extra = sorted(current.keys() - state.keys()), sorted(state.keys() - current.keys())
            raise ValueError(f"a state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    out: StateDict = {}
    for name, now in current.items():
        if not now.is_floating_point():
            out[name] = torch.stack([s[name] for s in states]).amax(0)
            continue
        dtype = torch.float64 if now.dtype == torch.float64 else torch.float32
        step = torch.zeros_like(now, dtype=dtype)
        for state, base, c in zip(states, bases, coefficients, strict=True):
            step.add_(state[name].to(dtype) - base[name].to(dtype), alpha=c)  # sum_k p_k s_k (w_k - b_k)
        out[name] = now.to(dtype, copy=True).add_(step, alpha=server_lr).to(now.dtype)  # w + server_lr (...)
    return out
