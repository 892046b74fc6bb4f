"""Both halves of a method in one process, no bus: what `fedmq.testing.check_method` runs a method in.

A few nodes with label-skewed synthetic shards, a shared workspace model and spare models, rounds
driven by the coordinator's own engine (`SyncRounds` on the in-process driver,
`coordinator.drivers.local`), as the daemons drive them. fedmq's own tests of each method use it too."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fedmq.coordinator.config import CoordinatorConfig, RoundPolicy
from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
from fedmq.coordinator.engine import SyncRounds
from fedmq.coordinator.engine import events as e
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import (
    AlgorithmSpec,
    CoordinatorHalf,
    NodeHalf,
    NodeUpdate,
    Payload,
    RoundContext,
    TaskInput,
)
from fedmq.fedcore.data import TensorDataset, load_dataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.training import TrainSettings

SETTINGS = TrainSettings(local_epochs=2, batch_size=8, lr=0.1, momentum=0.5)
INPUT_SHAPE = (4,)
CLASSES = 3
SHARD_SIZES = (20, 30, 40)
MAX_ROUNDS = 1_000_000
"""The engine's `rounds`: a `Federation` runs as many as its `run` calls ask for, never this many."""


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
    """A round's context as the engine hands it to `aggregate` (the same random stream)."""
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
class Rounds(LocalFederation):
    """The in-process driver, paused after each `run`'s last evaluation.

    The engine starts the next round in the same step that ends one, so the driver holds the last
    round's `Evaluated` until the next `run` has set who is online: the next cohort is sampled
    from them. The metrics each aggregation reports (as the daemon logs them) are kept in order."""

    pause_after: int = 0
    """Hold the `Evaluated` of this round (0-based)."""
    held: e.Evaluated | None = None
    aggregated: list[Mapping[str, float]] = field(default_factory=list)

    def _now(self, event: e.Event) -> None:
        if isinstance(event, e.Aggregated):
            self.aggregated.append(dict(event.metrics))
        if isinstance(event, e.Evaluated) and getattr(self.engine, "round", 0) >= self.pause_after:
            self.held = event
            return
        super()._now(event)

    def resume(self) -> None:
        """Let the held round end (after the availability changes already scheduled)."""
        if self.held is not None:
            self.at(self.clock.now(), self.held)
            self.held = None


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
        self.local: Rounds | None = None
        """The driver and its engine, from the first `run` on."""
        self.metrics: list[Mapping[str, float]] = []
        """What each aggregation reported (the half's metrics and its averaging rule's), by round."""
        self.participation = ParticipationRecord()
        """The engine's record from the first `run` on (selection at configure, acceptance before `aggregate`)."""
        self.round = 0
        """Rounds run so far: the round `train` trains for."""

    def train(self, node: str, payload: Payload, attempt: int = 0) -> NodeUpdate:
        """`node` trains on `payload` as the driver has it train in round `self.round` (the same stream)."""
        data = self.data[self.node_ids.index(node)]
        task = TaskInput(node_id=node, round=self.round, payload=payload, settings=SETTINGS, scratch=self.scratch)
        generator = torch_generator(self.seed, "node-train", node, self.round, attempt)
        out = self.nodes[node].train(task, self.workspace, data, generator)
        # the update aliases the workspace, which the next node reuses: copy it, as the daemon's encoding does
        tensors = {group: clone(state) for group, state in out.tensors.items()}
        return NodeUpdate(
            node_id=node, round=self.round, num_samples=len(data), payload=Payload(tensors=tensors, meta=out.meta)
        )

    def _driver(self, taking_part: int) -> Rounds:
        policy = RoundPolicy(fraction=1.0, min_nodes=taking_part, min_updates=1)
        config = CoordinatorConfig(federation="tests", rounds=MAX_ROUNDS, seed=self.seed, policy=policy, train=SETTINGS)
        engine = SyncRounds(config, self.coordinator.update_schema(), evaluates=True)
        self.participation = engine.participation
        return Rounds(
            engine=engine,
            half=self.coordinator,
            nodes={},
            workspace=self.workspace,
            seed=self.seed,
            scratch=self.scratch,
            aggregated=self.metrics,
        )

    def run(self, rounds: int, selected: tuple[str, ...] | None = None) -> StateDict:
        """`rounds` more rounds of the engine with the `selected` nodes online (all by default); the
        global model after them. Every online node is selected (fraction 1)."""
        chosen = self.node_ids if selected is None else tuple(selected)
        local = self.local = self.local or self._driver(len(chosen))
        local.half = self.coordinator  # a test may swap in a restored half between runs
        local.nodes = {n: LocalNode(self.nodes[n], d) for n, d in zip(self.node_ids, self.data, strict=True)}
        local.offline(*(n for n in self.node_ids if n not in chosen))
        local.online(*chosen)
        engine = local.engine
        assert isinstance(engine, SyncRounds)
        local.pause_after = engine.round + (local.held is not None) + rounds - 1
        local.resume()
        local.run(until=lambda: local.held is not None)
        if engine.finished:
            raise RuntimeError(f"the engine stopped: {engine.state} {engine.error}")
        self.round = local.pause_after + 1
        return clone(self.coordinator.model.state_dict())


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
