"""Both halves of an algorithm in one process, no bus: a few nodes with label-skewed synthetic
shards, a shared workspace model and spare models, rounds driven as the daemons drive them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedcore.algorithms import build_hyperparams, get_algorithm
from fedcore.algorithms.base import (
    AlgorithmSpec,
    CoordinatorHalf,
    NodeHalf,
    NodeUpdate,
    Payload,
    RoundContext,
    TaskInput,
)
from fedcore.data import TensorDataset, load_dataset
from fedcore.models import build_model
from fedcore.participation import ParticipationRecord
from fedcore.seeding import torch_generator
from fedcore.tensors import StateDict
from fedcore.training import TrainSettings

SETTINGS = TrainSettings(local_epochs=2, batch_size=8, lr=0.1, momentum=0.5)
INPUT_SHAPE = (4,)
CLASSES = 3
SHARD_SIZES = (20, 30, 40)


class Scratch:
    """`TaskInput.scratch` as the node daemon's workspace gives it: spare copies of one model, by key."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules: dict[str, nn.Module] = {}

    def __call__(self, key: str, build: Callable[[], nn.Module] | None = None) -> nn.Module:
        if key not in self.modules:
            self.modules[key] = build() if build is not None else copy.deepcopy(self.model)
        return self.modules[key]


def shards(seed: int = 0) -> list[TensorDataset]:
    """Three label-skewed shards of 20, 30 and 40 samples (4 features, 3 classes): sorted by label
    and cut in order, so each node sees mostly one or two classes."""
    train = load_dataset("synthetic", seed=seed, features=4, num_classes=CLASSES, train_size=90).train
    order = torch.argsort(train.y, stable=True)
    out, start = [], 0
    for size in SHARD_SIZES:
        out.append(train.subset(order[start : start + size].numpy()))
        start += size
    return out


def tiny_model(seed: int = 0, name: str = "mlp", input_shape: tuple[int, ...] = INPUT_SHAPE) -> nn.Module:
    options: dict[str, object] = {"hidden": [8]} if name == "mlp" else {}
    return build_model(name, input_shape, CLASSES, seed=seed, **options)


def context(
    round: int, selected: tuple[str, ...], seed: int = 0, participation: ParticipationRecord | None = None
) -> RoundContext:
    return RoundContext(
        round=round,
        selected=selected,
        participation=participation if participation is not None else ParticipationRecord(),
        settings=SETTINGS,
        generator=torch_generator(seed, "coordinator", "aggregate", round),
    )


def clone(state: Mapping[str, torch.Tensor]) -> StateDict:
    return {k: v.detach().clone() for k, v in state.items()}


@dataclass
class Federation:
    """A coordinator half, one node half per node, one workspace model shared by the nodes."""

    name: str | AlgorithmSpec
    """A registered method's name, or a module's SPEC (before it is registered)."""
    hyperparams: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    model: str = "mlp"
    data: list[TensorDataset] = field(default_factory=shards)
    input_shape: tuple[int, ...] = INPUT_SHAPE

    def __post_init__(self) -> None:
        spec = self.name if isinstance(self.name, AlgorithmSpec) else get_algorithm(self.name)
        hp = build_hyperparams(spec, self.hyperparams)
        self.coordinator: CoordinatorHalf = spec.coordinator(
            hp, model=tiny_model(self.seed, self.model, self.input_shape)
        )
        self.node_ids = tuple(f"node-{i:03d}" for i in range(len(self.data)))
        self.nodes: dict[str, NodeHalf] = {n: spec.node(hp, node_id=n) for n in self.node_ids}
        self.workspace = tiny_model(99, self.model, self.input_shape)  # other weights: each task overwrites them
        self.scratch = Scratch(self.workspace)
        self.metrics: list[Mapping[str, float]] = []
        self.participation = ParticipationRecord()
        """Written as the coordinator daemon writes it: selection, then acceptance before `aggregate`."""
        self.round = 0

    def train(self, node: str, payload: Payload) -> NodeUpdate:
        data = self.data[self.node_ids.index(node)]
        task = TaskInput(node_id=node, round=self.round, payload=payload, settings=SETTINGS, scratch=self.scratch)
        out = self.nodes[node].train(
            task, self.workspace, data, torch_generator(self.seed, "node-train", node, self.round)
        )
        # the update aliases the workspace, which the next node reuses: copy it, as the daemon's encoding does
        tensors = {group: clone(state) for group, state in out.tensors.items()}
        return NodeUpdate(
            node_id=node, round=self.round, num_samples=len(data), payload=Payload(tensors=tensors, meta=out.meta)
        )

    def run(self, rounds: int, selected: tuple[str, ...] | None = None) -> StateDict:
        """`rounds` rounds with the `selected` nodes (all by default); the global model after them."""
        for _ in range(rounds):
            chosen = self.node_ids if selected is None else selected
            ctx = context(self.round, chosen, self.seed, self.participation)
            self.participation.selected(chosen, self.round)
            payload = self.coordinator.configure_round(ctx)
            payload = Payload(tensors={g: clone(s) for g, s in payload.tensors.items()}, meta=dict(payload.meta))
            updates = [self.train(node, payload) for node in chosen]
            for u in updates:
                self.participation.accepted(u.node_id, self.round, num_samples=u.num_samples)
            self.metrics.append(self.coordinator.aggregate(ctx, updates, []))
            self.round += 1
        return clone(self.coordinator.model.state_dict())


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
