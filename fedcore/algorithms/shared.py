"""What several methods share, so that none of them borrows it from another method's module.

- The node side of every method: `load_group` (a task's tensor group into a model) and `task_flag`
  (a true/false switch from the task's meta), both checked because they came over the wire.
- FedAvg's server, `AveragingCoordinator`: broadcast the model, average the updates weighted by
  their sample counts (`fedavg.CoordinatorHalf` adds FedAvg's `weighted` option to it), report
  `mean_reported_loss`. Methods that change only the local training reuse it as it is.
- `LossTermNode`, the template of "FedAvg plus a loss term": the node loads the global model, trains
  with `local_sgd` on the method's objective and returns the model; a subclass gives the objective
  (`LossTermNode.objective`), and a hook when it keeps state (`trained`) or trains otherwise (`fit`).
- Group training: `start_group` (what every `train_group` checks and loads first), `gradient_terms`
  (the group form of a gradient added after the backward pass: SCAFFOLD, FedDyn), and
  `model_update` (an update that carries the trained model alone).
- Small pieces of several methods: the trainable parameters and their accumulator dtypes (SCAFFOLD,
  FedDyn, FedAvgM), a node's state per parameter (`node_state`: SCAFFOLD, FedDyn), a checkpointed
  dict of tensors (`load_tensors`) and its norm (`state_norm`), the federation size N (SCAFFOLD,
  FedDyn), a node's label counts (FedLC, FedRS, FedVLS), the shape of a FedModel and the update's
  class means, their schema and their checks (FedNH, FedProto), per-class sums that repeat bit for bit
  on a GPU (`add_rows`: FedACD, FedNH, FedProto), and the filter that leaves invalid updates out with
  a warning.
"""

from __future__ import annotations

import logging
import math
from abc import abstractmethod
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, cast

import torch
from torch import nn

from fedmq.fedcore.aggregation import weighted_average
from fedmq.fedcore.algorithms import base
from fedmq.fedcore.algorithms.base import mean_reported_loss
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.round_plan import BatchOutput
from fedmq.fedcore.tensors import StateDict, TensorSpec
from fedmq.fedcore.training import LossFn, TrainSettings, TrainStats, local_sgd
from fedmq.fedcore.vectorized import (
    GroupObjective,
    NodeBatch,
    cross_entropy_objective,
    functional_method,
    nll,
    train_vectorized,
    trained_sample,
    unsupported,
)

logger = logging.getLogger(__name__)

# -- the task and the update -----------------------------------------------------------------------


def load_group(task: base.TaskInput, group: str, model: nn.Module, *, node_id: str) -> None:
    """Load the task's tensor group `group` (the global model, a teacher) into `model`; a group that
    is missing or does not fit the model is an AlgorithmError, not a KeyError deep in training."""
    try:
        model.load_state_dict(task.payload.tensors[group])
    except (KeyError, RuntimeError) as exc:
        raise AlgorithmError(f"task carries no usable {group}: {exc}", node_id=node_id, round=task.round) from exc


def task_flag(task: base.TaskInput, key: str, *, node_id: str, default: bool | None = None) -> bool:
    """A true/false switch from the task's meta (FedGKD's and KDIA's "distill"); anything else,
    or a missing key without a `default`, is an AlgorithmError: the value came over the wire."""
    value = task.payload.meta.get(key, default)
    if not isinstance(value, bool):
        message = f"task meta {key!r} must be true or false, got {value!r}"
        raise AlgorithmError(message, node_id=node_id, round=task.round)
    return value


def model_update(state: StateDict, stats: TrainStats) -> base.Payload:
    """The update of a node that sends its trained model alone: the model, the training loss and the step count."""
    return base.Payload(tensors={"model": state}, meta={"loss": stats.loss, "steps": stats.steps})


def sample_weights(updates: Sequence[base.NodeUpdate], *, weighted: bool = True) -> list[float]:
    """Each update's weight in an average: its number of samples n_k, or 1 when not `weighted`."""
    return [float(u.num_samples) if weighted else 1.0 for u in updates]


def sync_average(
    half: base.CoordinatorHalf, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], weights: Sequence[float]
) -> StateDict:
    """The mean of the updates' models by the half's averaging rule (``half.average``: the weighted
    mean, or FedSA's), weighted by `weights` discounted by staleness: the average a sync-only half
    takes for its own rule (SCAFFOLD, FedDyn, FedProto), where `next_model` would fold by
    ``ctx.folding``'s. No update is an AlgorithmError."""
    if not updates:
        raise AlgorithmError("no update to aggregate", round=ctx.round)
    models = [u.payload.tensors["model"] for u in updates]
    return half.average(models, base.staleness_weighted(ctx, updates, weights))


def valid_updates(
    ctx: base.RoundContext,
    updates: Sequence[base.NodeUpdate],
    problem: Callable[[base.NodeUpdate], str | None],
    log: logging.Logger,
) -> list[base.NodeUpdate]:
    """The updates for which `problem` finds nothing wrong; each other one is left out with a warning on `log`."""
    valid = []
    for update in updates:
        reason = problem(update)
        if reason is None:
            valid.append(update)
        else:
            log.warning("round %d: update of %s left out: %s", ctx.round, update.node_id, reason)
    return valid


# -- FedAvg's server, and a node that adds a loss term to FedAvg's training -----------------------


PROBE = (("a", 3), ("b", 5))
"""Two updates' node ids and sample counts, to check that a half weights updates by their counts."""


class AveragingCoordinator(base.CoordinatorHalf[base.H]):
    """FedAvg's server: every selected node receives the global model, and the next global model is
    the average of the updates (``self.average``) weighted by `weights`, their sample counts.

    Async mode: the server keeps no state besides the model, so a buffer of stale updates folds by
    ``ctx.folding`` (`next_model`) like a round's; every method that reuses this half inherits that
    unless it says otherwise."""

    sync_only: ClassVar[str | None] = None

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(tensors={"model": self.model.state_dict()})

    def weights(self, updates: Sequence[base.NodeUpdate]) -> list[float]:
        """The unnormalised weight of each update in the average: n_k (FedAvg, Algorithm 1)."""
        return sample_weights(updates)

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = self.weights(updates)
        # w_{t+1} = sum_k (n_k / sum_j n_j) w^k_{t+1}, over the accepted updates only (async: ctx.folding)
        self.model.load_state_dict(self.next_model(ctx, updates, weights))
        return {"train_loss": mean_reported_loss(updates, weights)}

    aggregates_the_mean: ClassVar[bool] = False
    """A subclass with its own `aggregate` sets it when that `aggregate` sees the updates only through
    their sample-weighted mean and mean reported loss (FedAvgM: momentum on the mean), so that site
    aggregators may send partial means (`partial`)."""

    def partial_refusal(self) -> str | None:
        """Partial means add up to the flat one while the average is the weighted mean, the weights are
        the sample counts, and `aggregate` is this class's (or says `aggregates_the_mean`)."""
        name = f"{type(self).__module__}.{type(self).__qualname__}"
        if self.average is not weighted_average:
            return "its averaging rule (method.aggregator) is not the weighted mean, which partial means do not give"
        own = next(c for c in type(self).__mro__ if "aggregate" in vars(c))
        if own is not AveragingCoordinator and not self.aggregates_the_mean:
            return f"{name} aggregates in its own way, not from the weighted mean of the updates alone"
        probe = [base.NodeUpdate(node_id=n, round=0, num_samples=k, payload=base.Payload()) for n, k in PROBE]
        if self.weights(probe) != [float(k) for _, k in PROBE]:
            return f"{name} does not weight updates by their sample counts (fedavg's weighted: false?)"
        return None

    def partial(self, updates: Sequence[base.NodeUpdate]) -> tuple[base.Payload, int]:
        """The updates' sample-weighted mean, claiming the sum of their counts: the coordinator's
        weighted mean of such partials is the weighted mean of all their updates. The reported loss
        is averaged the same way (over the updates that reported one)."""
        reason = self.partial_refusal()
        if reason is not None:
            raise NotImplementedError(reason)
        if not updates:
            raise ValueError("a partial aggregate needs at least one update")
        weights = sample_weights(updates)
        tensors = {
            group: weighted_average([u.payload.tensors[group] for u in updates], weights)
            for group in updates[0].payload.tensors
        }
        loss = mean_reported_loss(updates, weights)
        meta = {} if math.isnan(loss) else {"loss": loss}  # NaN when none reported one
        return base.Payload(tensors=tensors, meta=meta), sum(u.num_samples for u in updates)


@dataclass(frozen=True, slots=True)
class GroupTerm:
    """A method's objective in the form the vectorised trainer maps over a group of nodes
    (`fedcore.vectorized.NodeBatch`): one pure function for every member, and each member's own
    tensors (label counts, offsets) in `inputs`. What the task gives every member alike (the global
    model, a teacher sent with it) may be captured by the function: the members share one task."""

    objective: GroupObjective
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    key: Hashable | None = None
    """Set when `objective` reads nothing but its `NodeBatch` (the members' `inputs` included), the
    values in the key (the hyperparameters) and tensors whose addresses the key holds (a spare model's,
    loaded in place): a later round's group may then train in this one's kept round, its graphs
    included (`fedcore.vectorized.keep_rounds`, `simulation.reuse_rounds`). None: built afresh each time."""
    outputs: dict[str, BatchOutput] = field(default_factory=dict)
    """What the objective reads of a frozen model on each step's batch (`NodeBatch.step[name]`), made
    before the steps run (`frozen_output`); under `key`, the tensors they read are the key's too."""


def frozen_output(
    model: nn.Module,
    data: TensorDataset,
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    method: str = "forward",
    then: Callable[[Any], torch.Tensor] | None = None,
    node_params: str | None = None,
) -> BatchOutput:
    """``then(model.<method>(x))`` on a step's batch x, with `params` in place of the model's trainable
    parameters (a teacher's; None: the model's own, the global model the group starts from, which the
    workspace holds while the group trains), in the model's dtype: a frozen model's output that the
    vectorised step reads instead of running the model at every step (`BatchOutput`). Its shape is that
    of one sample of `data` (a member's), and it must not depend on the batch's other samples.
    `node_params`: each node's own model instead (MOON's previous ones), its parameters in the node's
    `GroupTerm.inputs` under this prefix (``previous0.`` + the parameter's name): a per-node output."""
    run = functional_method(model, method)
    first = next(model.parameters())
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    own = {name: params[name] for name in names} if params is not None else {}

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = run(own, x)
        return cast(torch.Tensor, out if then is None else then(out)).to(first.dtype)

    def node_fn(x: torch.Tensor, node_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out = run({name: node_inputs[f"{node_params}{name}"] for name in names}, x)
        return cast(torch.Tensor, out if then is None else then(out)).to(first.dtype)

    with torch.no_grad():  # on the model's own parameters: a node's have the same shapes
        one = fn(trained_sample(data, first.device))
    if node_params is not None:
        return BatchOutput(node_fn, tuple(one.shape[1:]), first.dtype, per_node=True)
    return BatchOutput(fn, tuple(one.shape[1:]), first.dtype)


class LossTermNode(base.NodeHalf[base.H]):
    """FedAvg's local training on the method's own per-batch objective: load the global model, set
    up the objective (`objective`), train (`fit`), keep what the method keeps (`trained`), return
    the model with the loss and step count.

    A subclass that also writes its objective as a `GroupTerm` (`group_term`) trains a group of
    nodes that received the same task as one vectorised computation (`train_group`)."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        load_group(task, "model", model, node_id=self.node_id)
        objective = self.objective(task, model, data)
        stats = self.fit(model, data, task.settings, generator, objective)
        if objective is not None:
            self.trained(model)
        return model_update(model.state_dict(), stats)

    @abstractmethod
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        """The loss of one mini-batch, ``loss(model, x, y)``, set up from the global model just loaded
        into `model` (anchors, teachers, label counts); None at the method's neutral setting, where the
        node then trains exactly as FedAvg does."""

    def trained(self, model: nn.Module) -> None:
        """Called with the trained `model` after training on the method's own objective (not at the
        neutral setting): for a method that keeps something of it (MOON's previous models)."""

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> GroupTerm | None:
        """`objective` as a `GroupTerm`, set up from the global model just loaded into `model`; None at
        the method's neutral setting (the cross-entropy). A subclass that defines it must give, for
        every node, what `objective` gives within float tolerance (tests/fedcore/test_group_terms.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no vectorised form of its objective")

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: each member's `group_term`, one vectorised local SGD."""
        first = start_group(self, members, model)
        terms = [m.half.group_term(m.task, model, m.data) for m in members]  # type: ignore[attr-defined]
        neutral = terms[0] is None
        if any((t is None) != neutral for t in terms):
            raise ValueError("members of one group disagree on whether the method's term applies")
        objective = cross_entropy_objective if neutral else terms[0].objective
        names = [] if neutral else list(terms[0].inputs)
        inputs = {name: torch.stack([t.inputs[name] for t in terms]) for name in names}  # type: ignore[union-attr]
        keyed = None if neutral or terms[0].key is None else (type(self), terms[0].key)  # type: ignore[union-attr]
        outputs = {} if neutral else terms[0].outputs  # type: ignore[union-attr]
        results = self.fit_group(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members], objective, inputs,
            keep_as=keyed, outputs=outputs,
        )  # fmt: skip
        if not neutral:  # each member keeps what `train` keeps of its model (MOON: its previous model)
            with torch.no_grad():
                for member, (state, _) in zip(members, results, strict=True):
                    model.load_state_dict(state)
                    member.half.trained(model)  # type: ignore[attr-defined]
        return [model_update(state, stats) for state, stats in results]

    def group_refusal(self, model: nn.Module) -> str | None:
        """A subclass trains in groups when it writes its objective as a `GroupTerm` and keeps the
        template's training (`train`, `fit`). `trained` is called on each member's half with its
        trained model loaded into the workspace, as `train` calls it, so what a half keeps of its
        model (MOON's previous models) is kept; its `group_term` must then read that state."""
        cls = type(self)
        name = f"{cls.__module__}.{cls.__qualname__}"
        for hook in ("train", "train_group"):
            if _owner(cls, hook) is not LossTermNode:
                return f"{name} overrides {hook}, which group training does not reproduce"
        if _owner(cls, "fit") is not _owner(cls, "fit_group"):
            return f"{name} overrides fit, which group training does not reproduce (no fit_group beside it)"
        if _owner(cls, "group_term") is LossTermNode:
            return f"{name} has no vectorised form of its objective (group_term)"
        return unsupported(model)

    def fit(
        self,
        model: nn.Module,
        data: TensorDataset,
        settings: TrainSettings,
        generator: torch.Generator,
        objective: LossFn | None,
    ) -> TrainStats:
        """The local training: `local_sgd` on `objective`, or on the cross-entropy when it is None."""
        if objective is None:
            return local_sgd(model, data, settings, generator)
        return local_sgd(model, data, settings, generator, loss_fn=objective)

    def fit_group(
        self,
        model: nn.Module,
        datasets: Sequence[TensorDataset],
        settings: TrainSettings,
        generators: Sequence[torch.Generator],
        objective: GroupObjective,
        inputs: dict[str, torch.Tensor],
        *,
        keep_as: Hashable | None = None,
        outputs: Mapping[str, BatchOutput] | None = None,
    ) -> list[tuple[StateDict, TrainStats]]:
        """`fit` for a group: one vectorised `local_sgd` on the group's objective (kept from round to round
        under `keep_as`, its `GroupTerm.key`; `outputs`, its `GroupTerm.outputs`). A subclass that trains
        otherwise (`fit`) trains the group alike here, or its nodes train one by one."""
        return train_vectorized(
            model, datasets, settings, generators, objective=objective, inputs=inputs, keep_as=keep_as,
            outputs=outputs,
        )  # fmt: skip


def _owner(cls: type, name: str) -> type:
    """The class of `cls`'s MRO that defines `name`."""
    return next(c for c in cls.__mro__ if name in vars(c))


def start_group(half: base.NodeHalf, members: Sequence[base.GroupMember], model: nn.Module) -> base.GroupMember:
    """What a `train_group` does first: refuse a group the half cannot train (an AlgorithmError with
    `group_refusal`'s reason), check that the members received one task (`base.same_task`) and load
    its global model into the workspace `model`. The first member."""
    reason = half.group_refusal(model)
    if reason is not None:
        raise AlgorithmError(reason, node_id=half.node_id)
    first = base.same_task(members)
    load_group(first.task, "model", model, node_id=first.half.node_id)
    return first


def gradient_terms(terms: Callable[[NodeBatch], Iterable[torch.Tensor]]) -> GroupObjective:
    """The group objective of a method whose `train` adds the gradient of a term to each local step
    after the backward pass (SCAFFOLD's correction, FedDyn's regulariser): the cross-entropy plus the
    sum of `terms` (one per parameter) as ``term - term.detach()``, whose gradient is the term's and
    whose value is 0, so that the loss reported stays the cross-entropy, as `train` reports it."""

    def objective(batch: NodeBatch) -> torch.Tensor:
        term = sum(terms(batch))
        assert isinstance(term, torch.Tensor)  # a term of at least one parameter
        return batch.mean(nll(batch.logits(), batch.y)) + (term - term.detach())

    return objective


def frozen_model(task: base.TaskInput, key: str, group: str, *, node_id: str) -> nn.Module:
    """The task's tensor group `group` (the global model, a teacher) in the process's spare module
    `key` (`TaskInput.scratch`), in eval mode: a model the node runs without training it."""
    module = task.scratch(key)
    load_group(task, group, module, node_id=node_id)
    module.eval()
    return module


# -- parameters and checkpointed tensors ----------------------------------------------------------


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that carry per-parameter state (control variates, gradient states), by state-dict name."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def zero_state(params: Sequence[tuple[str, nn.Parameter]], device: str | None = None) -> dict[str, torch.Tensor]:
    """A zero tensor per named parameter, in its accumulator dtype, on `device` (default: the parameter's)."""
    return {name: torch.zeros_like(p.detach(), dtype=accumulator(p.dtype), device=device) for name, p in params}


def node_state(
    state: dict[str, torch.Tensor] | None, params: Sequence[tuple[str, nn.Parameter]], *, node_id: str, round: int
) -> dict[str, torch.Tensor]:
    """A node's tensor per trainable parameter, kept across rounds (SCAFFOLD's c_i, FedDyn's grad_k):
    `state`, or zero on the CPU before the node's first round (`state` None); an AlgorithmError when
    the model's parameters changed since."""
    if state is None:
        state = zero_state(params, device="cpu")
    if state.keys() != {name for name, _ in params}:
        message = "the model's parameters changed since this node's last round"
        raise AlgorithmError(message, node_id=node_id, round=round)
    return state


def state_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The Euclidean norm of all the entries of `tensors`, summed in float64: the size of a server
    state (FedAvgM's velocity, SCAFFOLD's c, FedDyn's h) as a metric."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def load_tensors(
    tensors: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], prefix: str, *, owner: str, what: str
) -> None:
    """Copy a checkpoint's ``prefix + name`` entries into `tensors` (in place, in their dtypes): the
    counterpart of ``{prefix + name: t}``. A missing, unexpected or misshapen entry is a ValueError
    naming `owner` (the method) and `what` (the tensors), and nothing is copied."""
    expected = {prefix + name for name in tensors}
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{owner} state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in tensors.items():
        saved = state[prefix + name]
        if tuple(saved.shape) != tuple(t.shape):
            raise ValueError(f"{owner} {what} {name} has shape {tuple(saved.shape)}, expected {tuple(t.shape)}")
    for name, t in tensors.items():
        t.copy_(state[prefix + name].to(t.dtype))


def federation_size(num_nodes: int, ctx: base.RoundContext, accepted: int, *, method: str) -> int:
    """N: `num_nodes` when set, else the nodes in the participation record; never fewer than the
    nodes known to exist (the record, this round's selection and its accepted updates)."""
    known = max(len(ctx.participation), len(set(ctx.selected)), accepted, 1)
    if num_nodes == 0:
        return known
    if num_nodes < known:
        logger.warning(
            "round %d: %s num_nodes = %d but %d nodes are known; using %d", ctx.round, method, num_nodes, known, known
        )
        return known
    return num_nodes


# -- the node's data -------------------------------------------------------------------------------


def local_label_counts(data: TensorDataset, model: nn.Module, *, node_id: str, round: int) -> torch.Tensor:
    """n_c, the node's number of training samples of each class, as float32 on the data's device.

    Computed from the whole local set (``data.label_histogram()``), never sent anywhere. An empty
    shard, or labels that do not fit the model's ``num_classes`` logits, is an AlgorithmError.
    """
    histogram = data.label_histogram()
    classes = getattr(model, "num_classes", data.num_classes)
    if len(histogram) != classes:
        message = f"labels span {len(histogram)} classes but the model has {classes} logits"
        raise AlgorithmError(message, node_id=node_id, round=round)
    if sum(histogram) <= 0:
        raise AlgorithmError("an empty training set has no label distribution", node_id=node_id, round=round)
    return torch.tensor(histogram, dtype=torch.float32, device=data.y.device)


def add_rows(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``target[index[i]] += values[i]`` for every i, in place (per-class sums: FedACD's P, FedNH's and
    FedProto's class means), the same on every run of one seed. On a CPU `index_add_`, which adds in
    order; on a CUDA device `index_add_` adds with atomics, in whatever order the threads land, so two
    runs of one seed differed in their last bits (and FedACD's training with them): there a one-hot
    matrix product instead, whose sums run in a fixed order."""
    if target.device.type == "cpu":
        target.index_add_(0, index, values.to(target.dtype))
    else:
        add_rows_by_product(target, index, values)


def add_rows_by_product(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """`add_rows` as a product of the rows' one-hot matrix with the values: no atomics on any device."""
    one_hot = torch.nn.functional.one_hot(index, target.shape[0]).to(target.dtype)
    target.add_((one_hot.T @ values.to(target.dtype).reshape(len(index), -1)).view(target.shape))


# -- prototype methods (FedNH, FedProto) -----------------------------------------------------------


def model_shape(model: nn.Module, method: str) -> tuple[int, int]:
    """(classes C, feature dimension d) of a FedModel; ValueError naming `method` for any other model."""
    classes, dim = getattr(model, "num_classes", None), getattr(model, "feature_dim", None)
    if not isinstance(classes, int) or not isinstance(dim, int) or not hasattr(model, "extract"):
        raise ValueError(f"{method} needs a FedModel (num_classes, feature_dim, extract), not {type(model).__name__}")
    return classes, dim


def node_model_shape(model: nn.Module, method: str, *, node_id: str, round: int) -> tuple[int, int]:
    """`model_shape` on a node: a model that is no FedModel is an AlgorithmError naming the node and round."""
    try:
        return model_shape(model, method)
    except ValueError as exc:
        raise AlgorithmError(str(exc), node_id=node_id, round=round) from exc


def class_means_schema(classes: int, dim: int) -> dict[str, TensorSpec]:
    """The ``class_means`` group of an update: float32 ``means`` (C, d) and int64 ``counts`` (C,)
    (`class_means_problem` checks what a schema cannot)."""
    return {"means": TensorSpec(torch.float32, (classes, dim)), "counts": TensorSpec(torch.int64, (classes,))}


def class_means_problem(update: base.NodeUpdate, classes: int, dim: int) -> str | None:
    """Why the update's ``class_means`` group (``means`` (C, d), integer ``counts`` (C,)) cannot be
    used, or None: they came over the wire."""
    stats = update.payload.tensors.get("class_means")
    if stats is None or "means" not in stats or "counts" not in stats:
        return "no class means"
    means, counts = stats["means"], stats["counts"]
    if tuple(means.shape) != (classes, dim) or tuple(counts.shape) != (classes,):
        return "class means or counts of the wrong shape"
    if counts.is_floating_point() or counts.dtype == torch.bool:
        return "counts are not integers"
    if bool((counts < 0).any()):
        return "negative counts"
    total = int(counts.sum())
    if not 0 < total <= update.num_samples:
        return f"counts sum to {total}, not in 1..{update.num_samples}"
    if not means.is_floating_point() or not bool(torch.isfinite(means).all()):
        return "class means are not finite numbers"
    return None
