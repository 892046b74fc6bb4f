"""FedRS: federated learning with restricted softmax.

Li and Zhan, "FedRS: Federated Learning with Restricted Softmax for Label Distribution Non-IID
Data", KDD 2021, https://doi.org/10.1145/3447548.3467254; code https://github.com/lxcnju/FedRepo
(``algorithms/fedrs.py``). Each node trains on the cross-entropy of restricted logits

    o_c = alpha_c f_c(x),   alpha_c = 1 if the node has samples of class c, alpha otherwise

(the "restricted softmax", p_c = exp(alpha_c w_c^T h) / sum_j exp(alpha_j w_j^T h)): the logits of
the classes a node lacks are scaled down, which limits how much local training pushes the
classifier rows of those classes. The coordinator is FedAvg's (sample-weighted average through
``self.average``); the label histogram stays on the node.

Paper vs code, and choices:
- `scaling`: "hard" (default) is the paper's alpha_c, 1 or alpha, as FedVLS's code implements its
  FedRS baseline (``clientrs.py``: ``output *= class2data``); "proportional" is FedRS's own code,
  alpha_c = alpha + (1 - alpha) n_c / max_j n_j, which also scales down the rarer present classes.
- The whole logit is scaled, bias included, as FedVLS's code does. The paper writes alpha_c w_c^T h
  and FedRS's code uses a bias-free classifier (``hs.mm(ws.T)``); on a bias-free head (e.g.
  ``conv2cifar``, or a ResNet with ``head_bias: false``) the forms coincide.
- FedRS's code clips gradients (``max_grad_norm``); that is the run's ``train.max_grad_norm``.
- ``alpha = 1`` trains exactly as FedAvg does (the scaling is skipped); ``alpha = 0`` removes the
  missing classes' logits from the softmax (their rows get no gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, nll

SCALINGS = ("hard", "proportional")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    alpha: float = 0.7
    """Restriction strength alpha in [0, 1], the scale of a missing class's logit (FedVLS's Table 10:
    0.7); 1 is FedAvg."""
    scaling: str = "hard"
    """"hard": alpha_c = 1 for present classes, alpha for missing ones (paper, FedVLS's code);
    "proportional": alpha + (1 - alpha) n_c / max n (FedRS's code)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "alpha")
        if self.alpha > 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha!r}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {self.scaling!r}")


def restriction_scales(counts: torch.Tensor, alpha: float, scaling: str) -> torch.Tensor:
    """alpha_c per class from the node's counts n_c: "hard" 1 if n_c > 0 else alpha;
    "proportional" alpha + (1 - alpha) n_c / max_j n_j."""
    if scaling == "hard":
        return torch.where(counts > 0, torch.ones_like(counts), torch.full_like(counts, alpha))
    if scaling == "proportional":
        return alpha + (1.0 - alpha) * counts / counts.max()
    raise ValueError(f"scaling must be one of {', '.join(map(repr, SCALINGS))}, got {scaling!r}")


def restricted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Batch-mean cross-entropy of the restricted logits alpha_c f_c(x)."""
    if scales.shape != logits.shape[-1:]:
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not fit {logits.shape[-1]} logits")
    return F.cross_entropy(logits * scales.to(logits.dtype), y)


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        if self.hp.alpha == 1.0:
            return None
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)
        scales = restriction_scales(counts, self.hp.alpha, self.hp.scaling)

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # CE over o_c = alpha_c f_c(x): the restricted softmax
            return restricted_cross_entropy(m(x), y, scales)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        if self.hp.alpha == 1.0:
            return None
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)

        def objective(batch: NodeBatch) -> torch.Tensor:
            logits = batch.logits()
            return batch.mean(nll(logits * batch.inputs["scales"].to(logits.dtype), batch.y))

        scales = restriction_scales(counts, self.hp.alpha, self.hp.scaling)
        return shared.GroupTerm(objective, {"scales": scales}, key=self.hp)


SPEC = base.AlgorithmSpec(name="fedrs", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
