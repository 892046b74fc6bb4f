"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data.

McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629. Nodes run local SGD from the global
model; the coordinator averages the returned models weighted by each node's number of samples
(Algorithm 1, line "w_{t+1} <- sum_k n_k/n w^k_{t+1}"), renormalised over the updates it accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedcore.algorithms import base
from fedcore.data import TensorDataset
from fedcore.errors import AlgorithmError
from fedcore.training import local_sgd
from fedcore.vectorized import train_vectorized, unsupported


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    weighted: bool = True
    """Weight updates by the node's number of samples (the paper); False gives the plain mean."""


class CoordinatorHalf(base.CoordinatorHalf):
    """Async mode: the server keeps no state besides the model, so a buffer of stale updates folds
    by ``ctx.folding`` (`next_model`) like a round's; every method that reuses this half inherits
    that unless it says otherwise."""

    hp: Hyperparams
    sync_only = None

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(tensors={"model": self.model.state_dict()})

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weighted = getattr(self.hp, "weighted", True)  # methods that reuse this server have no such option
        weights = [float(u.num_samples) if weighted else 1.0 for u in updates]
        # w_{t+1} = sum_k (n_k / sum_j n_j) w^k_{t+1}, over the accepted updates only (async: ctx.folding)
        self.model.load_state_dict(self.next_model(ctx, updates, weights))
        return {"train_loss": mean_reported_loss(updates, weights)}


def mean_reported_loss(updates: Sequence[base.NodeUpdate], weights: Sequence[float]) -> float:
    """The weighted mean of the training losses the nodes reported (meta ``loss``), over the updates
    that reported a finite number; NaN when none did. The value comes from the wire: anything that
    is not a finite number is left out, never trusted."""
    total = weight_sum = 0.0
    for update, weight in zip(updates, weights, strict=True):
        loss = base.wire_number(update.payload.meta.get("loss"))
        if loss is not None:
            total += weight * loss
            weight_sum += weight
    return total / weight_sum if weight_sum > 0 else float("nan")


class NodeHalf(base.NodeHalf):
    hp: Hyperparams

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        load_group(task, "model", model, node_id=self.node_id)
        stats = local_sgd(model, data, task.settings, generator)
        return base.Payload(tensors={"model": model.state_dict()}, meta={"loss": stats.loss, "steps": stats.steps})

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: local SGD from the one broadcast model, vectorised."""
        reason = self.group_refusal(model)
        if reason is not None:  # a subclass with its own `train` (FedDisco) inherits this method, not its use
            raise AlgorithmError(reason, node_id=self.node_id)
        first = base.same_task(members)
        load_group(first.task, "model", model, node_id=first.half.node_id)
        results = train_vectorized(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members]
        )
        return [
            base.Payload(tensors={"model": state}, meta={"loss": stats.loss, "steps": stats.steps})
            for state, stats in results
        ]

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)


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


SPEC = base.AlgorithmSpec(name="fedavg", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
