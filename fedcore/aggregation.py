"""Aggregation primitives shared by strategies."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedcore.tensors import StateDict

Aggregator = Callable[[Sequence[StateDict], Sequence[float]], StateDict]
"""(client models, their weights) -> one model: the step FedSA replaces in any averaging method."""


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
