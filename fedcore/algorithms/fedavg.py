"""FedAvg: Communication-Efficient Learning of Deep Networks from Decentralized Data.

McMahan et al., AISTATS 2017, https://arxiv.org/abs/1602.05629. Nodes run local SGD from the global
model; the coordinator averages the returned models weighted by each node's number of samples
(Algorithm 1, line "w_{t+1} <- sum_k n_k/n w^k_{t+1}"), renormalised over the updates it accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import local_sgd
from fedmq.fedcore.vectorized import train_vectorized, unsupported


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    weighted: bool = True
    """Weight updates by the node's number of samples (the paper); False gives the plain mean."""


class Weighted(Protocol):
    """What FedAvg's server reads of its hyperparameters; a method built on it (FedSA) has its own."""

    @property
    def weighted(self) -> bool: ...


W = TypeVar("W", bound=Weighted)


class CoordinatorHalf(shared.AveragingCoordinator[W]):
    """The shared averaging server with FedAvg's option: sample-count weights, or the plain mean."""

    def weights(self, updates: Sequence[base.NodeUpdate]) -> list[float]:
        return shared.sample_weights(updates, weighted=self.hp.weighted)


class NodeHalf(base.NodeHalf[base.H]):
    """Local SGD from the global model; it reads no hyperparameter, so a method built on it (FedDisco)
    gives it its own."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        stats = local_sgd(model, data, task.settings, generator)
        return shared.model_update(model.state_dict(), stats)

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: local SGD from the one broadcast model, vectorised. A
        subclass with its own `train` (FedDisco) inherits this method, and `start_group` refuses its use."""
        first = shared.start_group(self, members, model)
        results = train_vectorized(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members]
        )
        return [shared.model_update(state, stats) for state, stats in results]

    def group_refusal(self, model: nn.Module) -> str | None:
        """FedAvg's objective runs the model once a step, so a BatchNorm model trains in groups too
        (`fedcore.masked_norm`)."""
        return super().group_refusal(model) or unsupported(model, batch_norm=True)


SPEC = base.AlgorithmSpec(name="fedavg", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
