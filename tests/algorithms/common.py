"""Helpers of the methods' tests. The in-process federation they run methods in is the one a user's
method is checked in (`fedmq.testing.federation`), re-exported here; the rest are hand-made updates
and scalar models for checking aggregation rules by hand."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
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
    "CLASSES",
    "INPUT_SHAPE",
    "MAX_ROUNDS",
    "SETTINGS",
    "SHARD_SIZES",
    "Federation",
    "Rounds",
    "Scratch",
    "clone",
    "context",
    "same_state",
    "scalar_model",
    "scalar_state",
    "shards",
    "tiny_model",
    "update",
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
