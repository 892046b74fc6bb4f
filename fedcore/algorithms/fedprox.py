"""FedProx: federated optimisation with a proximal term.

Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in Heterogeneous Networks",
MLSys 2020, https://arxiv.org/abs/1812.06127. Each node minimises, from the global model w^t,

    h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2                        (Algorithm 2, Eq. 2)

with local SGD; the coordinator averages the returned models weighted by the nodes' sample counts,
as FedAvg does (and as KDIA's code does for its FedProx baseline).

Choices:
- The proximal term covers every trainable parameter (``model.parameters()``), not the buffers, as
  the authors' PyTorch ports and KDIA's code do; the squared norm is added to each mini-batch's loss,
  so the reported training loss is h_k, not F_k alone.
- The paper's variable amount of local work per device (gamma-inexact solutions, stragglers
  dropped or kept) is the framework's business (deadlines, `local_epochs`), not this module's.
- ``mu = 0`` trains exactly as FedAvg does (the term is skipped, not multiplied by zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, cross_entropy_objective, weighted_sum


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    mu: float = 0.01
    """Weight of the proximal term, non-negative (KDIA paper: grid 0.001, 0.01, 0.1, 1; default 0.01)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "mu")


def proximal_term(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """(mu / 2) sum_i ||params_i - anchor_i||^2; its gradient in params_i is mu (params_i - anchor_i)."""
    total = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
    for p, a in zip(params, anchor, strict=True):
        total = total + (p - a).pow(2).sum()
    return 0.5 * mu * total


def flat_proximal_term(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], mu: float) -> torch.Tensor:
    """`proximal_term` as one squared distance between the parameters and the anchor each laid end to end:
    under vmap, a handful of operators over all the nodes' parameters at once, forward and backward, where
    the sum term by term takes four a tensor forward and more backward (on a GPU about a kernel each).
    The same value up to rounding (the sum runs in another order)."""
    return 0.5 * mu * flat_squared_distance(params, anchor)


def flat_squared_distance(params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_i ||params_i - anchor_i||^2, the parameters and the anchor each laid end to end."""
    flat = torch.cat([p.reshape(-1) for p in params])
    start = torch.cat([a.reshape(-1) for a in anchor])
    return (flat - start).pow(2).sum()


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        mu = self.hp.mu
        if mu == 0.0:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        anchor = [p.detach().clone() for p in params]  # w^t, the global model this round starts from

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # h_k(w; w^t) = F_k(w) + (mu / 2) ||w - w^t||^2
            return F.cross_entropy(m(x), y) + proximal_term(params, anchor, mu)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        mu = self.hp.mu
        if mu == 0.0:
            return None

        def objective(batch: NodeBatch) -> torch.Tensor:
            # w^t is the model every member started from: batch.start
            anchor = [batch.start[name] for name in batch.params]
            distance = flat_squared_distance(list(batch.params.values()), anchor)
            return weighted_sum(cross_entropy_objective(batch), (0.5 * mu, distance))  # `flat_proximal_term`

        return shared.GroupTerm(objective, key=self.hp)


SPEC = base.AlgorithmSpec(name="fedprox", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
