"""The two halves of an algorithm and what passes between them.

The coordinator half decides what the selected nodes receive (`configure_round`) and how their
updates become the next global model (`aggregate`, through `next_model` for the model group); the
node half trains (`train`). Halves own no transport, no threads and no files: the daemons deliver
messages, run heavy calls in a worker thread, and hand every random draw in as a generator.

Synchronous and asynchronous aggregation. In sync mode `aggregate` is called once per round with
the round's updates and ``ctx.round`` is the round number. In async mode (FedAsync, FedBuff) the
engine buffers accepted updates and calls `aggregate` once per buffer; ``ctx.round`` is then the
index of the model version the buffer is folded into (0, 1, 2, ...), ``ctx.version`` that version,
every update says which version it trained from (`NodeUpdate.base_version`) and how many versions
old it is (`NodeUpdate.staleness`), and ``ctx.folding`` says how updates become the next model. A
half that cannot aggregate such updates says why in `CoordinatorHalf.sync_only`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import torch
from torch import nn

from fedmq.fedcore.aggregation import Aggregator, fedasync_step, fedbuff_step, weighted_average
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.staleness import CONSTANT, Staleness
from fedmq.fedcore.tensors import StateDict, TensorSpec, schema_of
from fedmq.fedcore.training import TrainSettings


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


FOLDING_RULES = ("mean", "fedasync", "fedbuff")


@dataclass(frozen=True, kw_only=True, slots=True)
class Folding:
    """How one aggregation's updates become the next global model (`CoordinatorHalf.next_model`).

    With w_v the current model, w_k update k's model, b_k the model it trained from (version
    `NodeUpdate.base_version`), tau_k its `NodeUpdate.staleness`, p_k the method's own weight of
    update k normalised to sum 1, s the `staleness` function and eta = `server_lr`:

    - ``mean``: the method's averaging rule (``self.average``: the weighted mean, or FedSA's) over
      the updates with weights p_k s(tau_k). With every staleness 0 it is the synchronous average,
      bit for bit (s(0) = 1 exactly). `server_lr` is not used.
    - ``fedasync``: w_{v+1} = w_v + eta sum_k p_k s(tau_k) (w_k - w_v) (Xie et al., FedAsync; with
      one update w <- (1 - alpha_t) w + alpha_t w_k, alpha_t = eta s(tau)).
    - ``fedbuff``: w_{v+1} = w_v + eta sum_k p_k s(tau_k) (w_k - b_k) (Nguyen et al., FedBuff,
      Algorithm 1 when p_k = 1/K: the buffer's staleness-scaled deltas averaged, server step eta).
    """

    rule: Literal["mean", "fedasync", "fedbuff"] = "mean"
    staleness: Staleness = CONSTANT
    """s(tau), the weight of an update tau versions old (`fedcore.staleness`)."""
    server_lr: float = 1.0
    """eta, the server step of the fedasync and fedbuff rules (FedAsync's alpha, FedBuff's eta_g); positive."""
    bases: Mapping[int, StateDict] = field(default_factory=dict)
    """The 'model' group each base version's nodes trained from, by version; the fedbuff rule needs
    it for every base version but the current one (``RoundContext.version``: the model itself)."""

    def __post_init__(self) -> None:
        if self.rule not in FOLDING_RULES:
            raise ValueError(f"folding rule must be one of {FOLDING_RULES}, got {self.rule!r}")
        if not isinstance(self.staleness, Staleness):
            raise ValueError(f"staleness must be a fedcore.staleness.Staleness, got {self.staleness!r}")
        if not (isinstance(self.server_lr, int | float) and math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"server_lr must be a positive number, got {self.server_lr!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundContext:
    round: int
    """The round number (sync), or the index of the model version being folded into (async)."""
    selected: tuple[str, ...]
    participation: ParticipationRecord
    """Read it; only the coordinator writes it."""
    settings: TrainSettings
    generator: torch.Generator = field(default_factory=torch.Generator)
    """The coordinator half's random stream for this round (seeded by the run's seed and the round)."""
    version: int = 0
    """The global model's version this step starts from: what ``self.model`` holds."""
    folding: Folding = field(default_factory=Folding)
    """How `CoordinatorHalf.next_model` turns the updates into the next model."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeUpdate:
    """An accepted update, already checked against `CoordinatorHalf.update_schema`."""

    node_id: str
    round: int
    num_samples: int
    payload: Payload
    train_seconds: float = 0.0
    rtt_seconds: float = 0.0
    base_version: int = 0
    """The model version the node trained from."""
    staleness: int = 0
    """Versions between `base_version` and the version it is folded into (filled by the engine); 0 in a sync round."""
    site_nodes: int = 0
    """0 for a node's own update; for a site aggregator's partial (hierarchical mode), how many of its
    nodes' updates it holds."""


@dataclass(frozen=True, slots=True)
class Failure:
    """A selected node whose update will not be aggregated this round, and why: ``stale`` is an
    update refused as staler than the run's max_staleness, ``expired`` an async task not answered
    within its deadline."""

    node_id: str
    round: int
    reason: Literal["late", "lost", "rejected", "failed", "stale", "expired"]
    detail: str = ""


def no_scratch(key: str, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """A task's `scratch` where it has no spare models (a bare `TaskInput`): a method that can do
    without one compares against it."""
    raise RuntimeError("this task has no scratch models")


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskInput:
    node_id: str
    round: int
    payload: Payload
    settings: TrainSettings
    scratch: Callable[..., nn.Module] = no_scratch
    """``scratch(key)`` gives a spare model of the training model's architecture on its device, and
    ``scratch(key, build)`` one made by `build`: kept by key and shared by the nodes of a process
    (they train one at a time), so a teacher or a previous model costs one module per process, not
    per node. Its weights are whatever the last user left: load what you need into it."""


H = TypeVar("H")
"""A method's frozen Hyperparams: ``class NodeHalf(base.NodeHalf[Hyperparams])`` types its `hp`."""


class CoordinatorHalf(ABC, Generic[H]):
    """Server side. Holds the global model; `hp` is the algorithm's frozen Hyperparams."""

    sync_only: ClassVar[str | None] = (
        "the method has not declared that it can aggregate asynchronous, staleness-weighted updates"
    )
    """Why this half cannot run in async mode (one sentence, shown to the user as a config error),
    or None when its `aggregate` folds buffers of stale updates correctly (through `next_model`)."""

    measured_metrics: ClassVar[frozenset[str]] = frozenset()
    """The metrics `aggregate` returns that this process measured (wall times: KDIA's seconds for its
    teacher and generator): logged like the others, but no replay can reproduce them, so `fedmq replay`
    leaves them out of its comparisons."""

    def __init__(self, hp: H, *, model: nn.Module, device: torch.device | None = None) -> None:
        self.hp = hp
        self.model = model
        self.device = device or torch.device("cpu")
        """Where heavy coordinator-side work (KDIA's generator) may run; the global model stays on the CPU."""
        self.average: Aggregator = weighted_average
        """How client models become one: the weighted mean by default; ``method.aggregator`` in an
        experiment file swaps in another rule (FedSA's) for any method whose server averages models."""

    @abstractmethod
    def configure_round(self, ctx: RoundContext) -> Payload | Mapping[str, Payload]:
        """What the selected nodes receive this round: one Payload for all of them (one broadcast,
        identical for all), or a mapping from each selected node id to its own Payload."""

    @abstractmethod
    def aggregate(
        self, ctx: RoundContext, updates: Sequence[NodeUpdate], failures: Sequence[Failure]
    ) -> Mapping[str, float]:
        """Fold the accepted updates into the global model; return scalar metrics for the round log.

        `updates` arrive sorted by node id, so that the result does not depend on arrival order (in
        async mode one node may have several updates in one call; they keep their arrival order).
        """

    def next_model(
        self, ctx: RoundContext, updates: Sequence[NodeUpdate], weights: Sequence[float], *, group: str = "model"
    ) -> StateDict:
        """The next global model from the updates' `group` tensors and the method's own per-update
        `weights` (unnormalised), by ``ctx.folding.rule`` (`Folding`): the mean through ``self.average``
        with weights w_k s(tau_k), or the fedasync or fedbuff step from the current model. The
        asynchronous rules fold the group "model" only (the current model is ``self.model``)."""
        folding = ctx.folding
        if len(updates) != len(weights):
            raise ValueError(f"next_model needs one weight per update, got {len(weights)} for {len(updates)}")
        states = [u.payload.tensors[group] for u in updates]
        if folding.rule == "mean":
            return self.average(states, staleness_weighted(ctx, updates, weights))
        discounts = [folding.staleness(u.staleness) for u in updates]
        if group != "model":
            raise ValueError(f"the {folding.rule} rule folds the model group only, not {group!r}")
        current = self.model.state_dict()
        if folding.rule == "fedasync":
            return fedasync_step(current, states, weights, discounts, server_lr=folding.server_lr)
        return fedbuff_step(
            current, states, [self._base(ctx, u) for u in updates], weights, discounts, server_lr=folding.server_lr
        )

    def _base(self, ctx: RoundContext, update: NodeUpdate) -> StateDict:
        """The model `update` trained from: ``ctx.folding.bases``, or the current model for the current version."""
        base = ctx.folding.bases.get(update.base_version)
        if base is not None:
            return base
        if update.base_version == ctx.version:
            return self.model.state_dict()
        known = sorted(ctx.folding.bases)
        raise ValueError(
            f"the fedbuff rule needs the model of version {update.base_version} (the base of {update.node_id}'s "
            f"update), but the folding holds only versions {known} and the current one is {ctx.version}"
        )

    def partial_refusal(self) -> str | None:
        """Why this half's aggregation cannot be done in parts, by site aggregators that each send one
        update for their nodes (hierarchical mode), or None when `partial` makes such an update."""
        return "the method has not declared that its aggregation can be done in parts by site aggregators"

    def partial(self, updates: Sequence[NodeUpdate]) -> tuple[Payload, int]:
        """Several nodes' updates as one update that speaks for them, and the sample count it claims:
        `aggregate` over such partial updates gives what it gives over the nodes' own, within float
        rounding. Only for a half whose `partial_refusal` is None."""
        raise NotImplementedError(self.partial_refusal() or f"{type(self).__name__} has no partial aggregation")

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


AVERAGE_STATE = "average/"
"""The prefix of the averaging rule's own state in `half_state` (central DP's adaptive clip norm)."""


def half_state(half: CoordinatorHalf) -> dict[str, torch.Tensor]:
    """What a checkpoint or a rollback keeps of the coordinator half besides its model: the method's
    extra state, and the state of an averaging rule that has one (``state_dict`` on ``half.average``)."""
    average = getattr(half.average, "state_dict", None)
    extra = {f"{AVERAGE_STATE}{k}": v for k, v in average().items()} if average is not None else {}
    return half.state_dict() | extra


def load_half_state(half: CoordinatorHalf, state: Mapping[str, torch.Tensor]) -> None:
    """`half_state`'s inverse: the method's part to the half, the averaging rule's to it."""
    own = {k: v for k, v in state.items() if not k.startswith(AVERAGE_STATE)}
    rule = {k.removeprefix(AVERAGE_STATE): v for k, v in state.items() if k.startswith(AVERAGE_STATE)}
    half.load_state_dict(own)
    load = getattr(half.average, "load_state_dict", None)
    if load is not None:
        load(rule)
    elif rule:
        raise ValueError(f"the averaging rule keeps no state, got {sorted(rule)[:5]}")


def staleness_weighted(ctx: RoundContext, updates: Sequence[NodeUpdate], weights: Sequence[float]) -> list[float]:
    """w_k s(tau_k): the method's weights discounted by each update's staleness (``ctx.folding.staleness``).

    s(0) == 1.0 exactly, so in a round of fresh updates the weights are unchanged bit for bit. For
    the averages `next_model` does not make (a sync-only method's, a late update carried into the
    next round)."""
    if len(updates) != len(weights):
        raise ValueError(f"one weight per update is needed, got {len(weights)} for {len(updates)}")
    s = ctx.folding.staleness
    return [float(w) * s(u.staleness) for u, w in zip(updates, weights, strict=True)]


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupMember:
    """One node of a group trained together (`NodeHalf.train_group`): what `train` would receive."""

    half: NodeHalf
    task: TaskInput
    data: TensorDataset
    generator: torch.Generator


class NodeHalf(ABC, Generic[H]):
    """Node side. One instance per node id; it may keep state across rounds (SCAFFOLD, MOON)."""

    def __init__(self, hp: H, *, node_id: str) -> None:
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


def mean_reported_loss(updates: Sequence[NodeUpdate], weights: Sequence[float]) -> float:
    """The weighted mean of the training losses the nodes reported (meta ``loss``), over the updates
    that reported a finite number; NaN when none did. The value comes from the wire: anything that
    is not a finite number is left out, never trusted."""
    total = weight_sum = 0.0
    for update, weight in zip(updates, weights, strict=True):
        loss = wire_number(update.payload.meta.get("loss"))
        if loss is not None:
            total += weight * loss
            weight_sum += weight
    return total / weight_sum if weight_sum > 0 else float("nan")
