"""The two halves of an algorithm and what passes between them.

The coordinator half decides what the selected nodes receive (`configure_round`) and how their
updates become the next global model (`aggregate`); the node half trains (`train`). Halves own no
transport, no threads and no files: the daemons deliver messages, run heavy calls in a worker
thread, and hand every random draw in as a generator.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from fedcore.aggregation import Aggregator, weighted_average
from fedcore.data import TensorDataset
from fedcore.participation import ParticipationRecord
from fedcore.tensors import StateDict, TensorSpec, schema_of
from fedcore.training import TrainSettings


def require_non_negative(hp: object, *names: str) -> None:
    """For Hyperparams.__post_init__: each named field is a finite number >= 0, or ValueError."""
    _require(hp, names, lambda v: v >= 0, "a non-negative number")


def require_positive(hp: object, *names: str) -> None:
    """For Hyperparams.__post_init__: each named field is a finite number > 0, or ValueError."""
    _require(hp, names, lambda v: v > 0, "a positive number")


def _require(hp: object, names: tuple[str, ...], ok: Callable[[float], bool], allowed: str) -> None:
    for name in names:
        value = getattr(hp, name)
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{name} must be {allowed}, got {value!r}")


def wire_number(value: object) -> float | None:
    """A finite int or float that came in an update's meta, else None: never trust the wire."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Payload:
    """Named groups of tensors (``{"model": state_dict}``) and msgpack-able scalars."""

    tensors: Mapping[str, StateDict] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundContext:
    round: int
    selected: tuple[str, ...]
    participation: ParticipationRecord
    """Read it; only the coordinator writes it."""
    settings: TrainSettings
    generator: torch.Generator = field(default_factory=torch.Generator)
    """The coordinator half's random stream for this round (seeded by the run's seed and the round)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeUpdate:
    """An accepted update, already checked against `CoordinatorHalf.update_schema`."""

    node_id: str
    round: int
    num_samples: int
    payload: Payload
    train_seconds: float = 0.0
    rtt_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Failure:
    """A selected node whose update will not be aggregated this round, and why."""

    node_id: str
    round: int
    reason: Literal["late", "lost", "rejected", "failed"]
    detail: str = ""


def _no_scratch(key: str, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    raise RuntimeError("this task has no scratch models")


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskInput:
    node_id: str
    round: int
    payload: Payload
    settings: TrainSettings
    scratch: Callable[..., nn.Module] = _no_scratch
    """``scratch(key)`` gives a spare model of the training model's architecture on its device, and
    ``scratch(key, build)`` one made by `build`: kept by key and shared by the nodes of a process
    (they train one at a time), so a teacher or a previous model costs one module per process, not
    per node. Its weights are whatever the last user left: load what you need into it."""


class CoordinatorHalf(ABC):
    """Server side. Holds the global model; `hp` is the algorithm's frozen Hyperparams."""

    def __init__(self, hp: Any, *, model: nn.Module, device: torch.device | None = None) -> None:
        self.hp = hp
        self.model = model
        self.device = device or torch.device("cpu")
        """Where heavy coordinator-side work (KDIA's generator) may run; the global model stays on the CPU."""
        self.average: Aggregator = weighted_average
        """How client models become one: the weighted mean by default; ``method.aggregator`` in an
        experiment file swaps in another rule (FedSA's) for any method whose server averages models."""

    @abstractmethod
    def configure_round(self, ctx: RoundContext) -> Payload:
        """What every selected node receives this round (one broadcast, identical for all)."""

    @abstractmethod
    def aggregate(
        self, ctx: RoundContext, updates: Sequence[NodeUpdate], failures: Sequence[Failure]
    ) -> Mapping[str, float]:
        """Fold the accepted updates into the global model; return scalar metrics for the round log.

        `updates` arrive sorted by node id, so that the result does not depend on arrival order.
        """

    def update_schema(self) -> dict[str, dict[str, TensorSpec]]:
        """The tensor groups an update must carry, with dtypes and shapes; anything else is rejected."""
        return {"model": schema_of(self.model.state_dict())}

    def evaluation_models(self) -> Mapping[str, nn.Module]:
        """The models to evaluate on the test set; the first is the one reported as ``accuracy``."""
        return {"global": self.model}

    def averaging_metrics(self) -> Mapping[str, float]:
        """What the averaging rule reports of its last call (FedSA's: share of dispersed parameters,
        clusters); read by the daemon after `aggregate` and logged with the round. None for the mean."""
        return dict(getattr(self.average, "metrics", {}))

    def round_records(self) -> Mapping[str, Sequence[Mapping[str, Any]]]:
        """JSON-able records of the round just aggregated, by log name: the daemon appends each list
        to ``<name>.jsonl`` in the run directory (KDIA: ``teacher_weights``). Read after `aggregate`."""
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Extra state to checkpoint besides the global model (server momentum, control variates)."""
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no extra state, got {sorted(state)[:5]}")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupMember:
    """One node of a group trained together (`NodeHalf.train_group`): what `train` would receive."""

    half: NodeHalf
    task: TaskInput
    data: TensorDataset
    generator: torch.Generator


class NodeHalf(ABC):
    """Node side. One instance per node id; it may keep state across rounds (SCAFFOLD, MOON)."""

    def __init__(self, hp: Any, *, node_id: str) -> None:
        self.hp = hp
        self.node_id = node_id

    @abstractmethod
    def train(self, task: TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator) -> Payload:
        """Train `model` (a workspace shared by the nodes of one process) and return the update.

        The returned tensors may alias `model`'s parameters: the daemon serialises them before the
        workspace is used again.
        """

    def train_group(self, members: Sequence[GroupMember], model: nn.Module) -> list[Payload]:
        """Train several nodes of this method that received the same task at once (one vectorised
        computation, `fedcore.vectorized`) and return each member's update, in order: what `train`
        gives each, within float tolerance. Called on one member's half; `model` is the shared
        workspace; the returned tensors must not alias it (the group's updates are serialised
        after the workspace is released). A method overrides it only when that holds."""
        raise NotImplementedError(f"{type(self).__name__} has no group training")

    def group_refusal(self, model: nn.Module) -> str | None:
        """Why the nodes of this method cannot be trained together with `model`, or None when they can.

        A class trains in groups only when it defines `train_group` itself, next to the `train` in
        use: a subclass that changes `train` (FedDisco adds to FedAvg's update) never inherits its
        parent's group training by accident."""
        if _defined_in(type(self), "train") is not _defined_in(type(self), "train_group"):
            return f"{type(self).__module__}.{type(self).__qualname__} has no group form of its training"
        return None


def _defined_in(cls: type, name: str) -> type:
    return next(c for c in cls.__mro__ if name in vars(c))


def same_task(members: Sequence[GroupMember]) -> GroupMember:
    """The first member, after checking that all are one method with one set of hyperparameters and
    received one task (round, settings): what a group needs to share; ValueError otherwise."""
    if not members:
        raise ValueError("a group needs at least one member")
    first = members[0]
    for m in members[1:]:
        if type(m.half) is not type(first.half) or m.half.hp != first.half.hp:
            raise ValueError(f"{m.task.node_id} runs another method or hyperparameters than {first.task.node_id}")
        if m.task.round != first.task.round or m.task.settings != first.task.settings:
            raise ValueError(f"{m.task.node_id} received another task than {first.task.node_id}")
    return first


@dataclass(frozen=True, slots=True)
class AlgorithmSpec:
    """How configs find an algorithm: its name, its Hyperparams class and its two halves."""

    name: str
    hyperparams: type
    coordinator: type[CoordinatorHalf]
    node: type[NodeHalf]
