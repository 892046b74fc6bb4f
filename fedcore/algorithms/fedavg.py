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

from fedcore.aggregation import weighted_average
from fedcore.algorithms import base
from fedcore.data import TensorDataset
from fedcore.errors import AlgorithmError
from fedcore.training import local_sgd


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    weighted: bool = True
    """Weight updates by the node's number of samples (the paper); False gives the plain mean."""


class CoordinatorHalf(base.CoordinatorHalf):
    hp: Hyperparams

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(tensors={"model": self.model.state_dict()})

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = [float(u.num_samples) if self.hp.weighted else 1.0 for u in updates]
        # w_{t+1} = sum_k (n_k / sum_j n_j) w^k_{t+1}, over the accepted updates only
        self.model.load_state_dict(weighted_average([u.payload.tensors["model"] for u in updates], weights))
        losses = [float(u.payload.meta.get("loss", float("nan"))) for u in updates]
        return {"train_loss": sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)}


class NodeHalf(base.NodeHalf):
    hp: Hyperparams

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        try:
            model.load_state_dict(task.payload.tensors["model"])
        except (KeyError, RuntimeError) as exc:
            raise AlgorithmError(
                f"task carries no usable model: {exc}", node_id=self.node_id, round=task.round
            ) from exc
        stats = local_sgd(model, data, task.settings, generator)
        return base.Payload(tensors={"model": model.state_dict()}, meta={"loss": stats.loss, "steps": stats.steps})


SPEC = base.AlgorithmSpec(name="fedavg", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
