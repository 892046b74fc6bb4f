"""Helpers of the methods' tests. The in-process federation they run methods in is the one a user's
method is checked in (`fedmq.testing.federation`), re-exported here; the rest are hand-made updates
and scalar models for checking aggregation rules by hand, a two-weight model for local steps by
hand, and checks several methods' tests make alike (determinism, a plain module refused, unusable
class means)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams
from fedmq.fedcore.algorithms.base import AlgorithmSpec, CoordinatorHalf, NodeUpdate, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import StateDict
from fedmq.testing.federation import (
    CLASSES,
    INPUT_SHAPE,
    MAX_ROUNDS,
    SETTINGS,
    SHARD_SIZES,
    Federation,
    Rounds,
    Scratch,
    clone,
    context,
    same_state,
    shards,
    tiny_model,
)

__all__ = [
    "BAD_CLASS_MEANS",
    "CLASSES",
    "INPUT_SHAPE",
    "MAX_ROUNDS",
    "SETTINGS",
    "SHARD_SIZES",
    "TWO_SAMPLE_GRADIENT",
    "Federation",
    "Rounds",
    "Scratch",
    "aggregate",
    "aggregate_scalars",
    "assert_deterministic",
    "clone",
    "column",
    "context",
    "empty_shard",
    "plain_module",
    "same_state",
    "scalar_model",
    "scalar_state",
    "scalar_value",
    "shards",
    "tiny_model",
    "train_alone",
    "two_sample_gradient",
    "two_samples",
    "two_weight_model",
    "update",
    "with_class_means",
]


def update(node: str, state: StateDict, num_samples: int, round: int = 0, **meta: Any) -> NodeUpdate:
    """A hand-made update, as the coordinator receives it after validation."""
    return NodeUpdate(
        node_id=node, round=round, num_samples=num_samples, payload=Payload(tensors={"model": state}, meta=meta)
    )


def scalar_model(value: float = 0.0) -> nn.Module:
    """One weight and no bias: aggregation rules checked by hand."""
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def scalar_state(value: float) -> StateDict:
    return {"weight": torch.full((1, 1), value)}


def scalar_value(t: torch.Tensor) -> float:
    """The value of a one-element tensor (a scalar model's weight, a server state's entry)."""
    return float(t.detach().reshape(()))


def aggregate(
    coordinator: CoordinatorHalf,
    updates: Sequence[NodeUpdate],
    round: int = 0,
    participation: ParticipationRecord | None = None,
) -> dict[str, float]:
    """One aggregation of `updates` in round `round`, their nodes the selected ones; the half's metrics."""
    ctx = context(round, tuple(u.node_id for u in updates), participation=participation)
    return dict(coordinator.aggregate(ctx, updates, []))


def aggregate_scalars(
    coordinator: CoordinatorHalf, rows: Sequence[tuple[float, int, dict[str, Any]]]
) -> tuple[float, dict[str, float]]:
    """One aggregation in round 0 of hand-made updates of a scalar model, node n{i} sending row i's
    (weight, num_samples, meta); the new global weight and the half's metrics."""
    updates = [update(f"n{i}", scalar_state(value), n, 0, **meta) for i, (value, n, meta) in enumerate(rows)]
    metrics = aggregate(coordinator, updates)
    return scalar_value(coordinator.model.weight), metrics


# -- a two-weight model on two samples, for local steps by hand (FedDyn, SCAFFOLD) -----------------


def two_samples() -> TensorDataset:
    """Two samples: x = 1 with label 0, x = 2 with label 1."""
    return TensorDataset(x=torch.tensor([[1.0], [2.0]]), y=torch.tensor([0, 1]), num_classes=2)


def column(a: float, b: float) -> torch.Tensor:
    return torch.tensor([[a], [b]])


def two_weight_model(w: tuple[float, float] = (0.0, 0.0)) -> nn.Module:
    """Logits (w0 x, w1 x): two weights, no bias."""
    model = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(column(*w))
    return model


def two_sample_gradient(w: float) -> float:
    """First coordinate of the mean cross-entropy gradient of `two_samples` at W = (w, -w) (the second
    is its negative), by hand: sample 1 (x = 1, y = 0) has p0 = 1 / (1 + e^{-2w}), sample 2 (x = 2,
    y = 1) p0 = 1 / (1 + e^{-4w}); the mean of (p0 - 1) x and p0 x."""
    p1, p2 = 1 / (1 + math.exp(-2 * w)), 1 / (1 + math.exp(-4 * w))
    return ((p1 - 1) * 1 + p2 * 2) / 2


TWO_SAMPLE_GRADIENT = two_sample_gradient(0.0)
"""0.25, the first coordinate of the gradient at W = 0: p = (1/2, 1/2) for both samples."""


# -- checks several methods' tests make alike ----------------------------------------------------


def assert_deterministic(
    spec: str | AlgorithmSpec, hyperparams: dict[str, Any] | None = None, rounds: int = 2
) -> Federation:
    """Two federations of `spec` with one seed end `rounds` rounds with the same global model and the
    same coordinator state; one with another seed ends them with another model. The first, for
    checks of its own."""
    options = hyperparams or {}
    a, b = Federation(spec, options), Federation(spec, options)
    assert same_state(a.run(rounds), b.run(rounds))
    assert same_state(a.coordinator.state_dict(), b.coordinator.state_dict())
    assert not same_state(a.coordinator.model.state_dict(), Federation(spec, options, seed=1).run(rounds))
    return a


def plain_module() -> nn.Module:
    """A module for 4 features and 3 classes with none of FedModel's interface (extract, classify,
    forward_taps, represent, num_classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3))


def empty_shard() -> TensorDataset:
    """A node's shard without a sample."""
    return shards()[0].subset(np.array([], dtype=np.int64))


def train_alone(
    spec: AlgorithmSpec,
    model: nn.Module,
    hyperparams: dict[str, Any] | None = None,
    data: TensorDataset | None = None,
) -> Payload:
    """Node "n0" of `spec` trains `model` from its own weights in round 2, on `data` (default: four
    samples of 4 features, 3 classes): for what a method refuses to train (an AlgorithmError naming
    n0 and round 2)."""
    half = spec.node(build_hyperparams(spec, hyperparams or {}), node_id="n0")
    payload = Payload(tensors={"model": model.state_dict()})
    task = TaskInput(node_id="n0", round=2, payload=payload, settings=SETTINGS, scratch=Scratch(model))
    if data is None:
        data = TensorDataset(torch.zeros(4, 4), torch.zeros(4, dtype=torch.long), 3)
    return half.train(task, model, data, torch_generator(0, "t"))


ClassMeans = tuple[torch.Tensor, torch.Tensor]

BAD_CLASS_MEANS: dict[str, Callable[[torch.Tensor, torch.Tensor], ClassMeans]] = {
    "negative-count": lambda m, c: (m, c - torch.tensor([c[0] + 1, 0, 0])),
    "no-samples": lambda m, c: (m, torch.zeros_like(c)),
    "more-than-num-samples": lambda m, c: (m, c + 1000),
    "float-counts": lambda m, c: (m, c.float()),
    "nan-mean": lambda m, c: (m.clone().fill_(float("nan")), c),
    "inf-mean": lambda m, c: (m.clone().fill_(float("inf")), c),
    "too-few-features": lambda m, c: (m[:, :4], c),
    "too-few-classes": lambda m, c: (m[:2], c),
}
"""An update's class means (``means`` (C, d), ``counts`` (C,)) made unusable, each from good ones:
what `shared.class_means_problem` refuses for FedNH and FedProto alike."""


def with_class_means(u: NodeUpdate, means: torch.Tensor, counts: torch.Tensor) -> NodeUpdate:
    """`u` with its class means replaced (and no meta)."""
    tensors = {**u.payload.tensors, "class_means": {"means": means, "counts": counts}}
    return NodeUpdate(node_id=u.node_id, round=u.round, num_samples=u.num_samples, payload=Payload(tensors=tensors))
