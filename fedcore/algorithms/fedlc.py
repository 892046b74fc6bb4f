"""FedLC: federated learning via logits calibration.

Zhang, Li, Li, Xu, Wu, Ding and Wu, "Federated Learning with Label Distribution Skew via Logits
Calibration", ICML 2022, https://arxiv.org/abs/2209.00189 (no official code). Each node trains on
the calibrated cross-entropy

    L_cal(x, y) = -log [ exp(f_y(x) - tau n_y^{-1/4}) / sum_c exp(f_c(x) - tau n_c^{-1/4}) ]

where n_c is the number of samples of class c in the node's whole training set: every logit is
lowered by a margin tau n_c^{-1/4}, larger for rarer classes. The coordinator is FedAvg's
(sample-weighted average through ``self.average``). The label histogram stays on the node.

This is the rule of ``clientlogitcal.py`` in FedVLS's code (github.com/krumpguo/FedVLS, the
baseline its ``main.py`` calls "FedLogitCal" and its paper "FedLC": ``output -= cal_tem *
class2data ** (-0.25)`` then cross-entropy), so that baseline is this module with its ``tau``.

Paper vs code, and choices:
- A class the node has no sample of (n_c = 0) gets the margin +inf, i.e. its logit becomes -inf
  and it drops out of the softmax, as in FedVLS's code (0 ** -0.25 = inf) and FL-bench; some other
  ports clamp n_c at 1e-8 (a finite margin of 100 tau). Its logit then gets no gradient from the loss.
- ``tau`` defaults to 0.5, FedVLS's Table 10 (fedvls.md 2.5); FedVLS's code defaults ``cal_tem``
  to 0.1, FedRCL's comparison uses tau = 1 (fedrcl.md). Set it per experiment.
- The denominator sums over every class, as all the implementations we know do. The paper's Eq. as
  we recall it sums over y' != y (a pairwise-margin form that is unbounded below); that recollection
  was not checked against the paper's text, which is not among this project's sources.
- The counts come from the node's whole local training set, computed at every round (the shard is
  static), not per batch (FedVLS code; some ports count per batch).
- FedVLS's FedLC client keeps its SGD optimiser (momentum) across rounds; here, as for every method
  (fedvls.md A9), the optimiser starts afresh each round.
- ``tau = 0`` trains exactly as FedAvg does (the term is skipped; FedVLS's code would compute 0 x inf
  = NaN for a missing class).

The label counts come from `shared.local_label_counts` (FedRS and FedVLS use it too); FedVLS reuses
`fedlc_offsets` and `calibrated_cross_entropy`.
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    tau: float = 0.5
    """Calibration strength tau in the margin tau n_c^{-1/4}, non-negative (FedVLS's Table 10: 0.5;
    FedVLS's code ``cal_tem``: 0.1; FedRCL's comparison: 1); 0 is FedAvg."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "tau")


def fedlc_offsets(counts: torch.Tensor, tau: float) -> torch.Tensor:
    """The additive logit offsets -tau n_c^{-1/4}; -inf for a class with n_c = 0 (when tau > 0)."""
    if tau == 0.0:
        return torch.zeros_like(counts)
    margins = tau * counts.clamp(min=1.0).pow(-0.25)
    return torch.where(counts > 0, -margins, torch.full_like(counts, float("-inf")))


def calibrated_cross_entropy(logits: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Batch-mean cross-entropy on ``logits + offsets`` (offsets per class, broadcast over the batch).

    FedLC: offsets -tau n_c^{-1/4}; FedVLS's Eq. 2: offsets log(p(c) + eps). An offset of -inf
    removes the class from the softmax (its logit gets zero gradient); it must not be a label's.
    """
    if offsets.shape != logits.shape[-1:]:
        raise ValueError(f"offsets of shape {tuple(offsets.shape)} do not fit {logits.shape[-1]} logits")
    return F.cross_entropy(logits + offsets.to(logits.dtype), y)


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        if self.hp.tau == 0.0:
            return None
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)
        offsets = fedlc_offsets(counts, self.hp.tau)

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # L_cal = CE(f(x) - tau n^{-1/4}, y), a missing class at -inf
            return calibrated_cross_entropy(m(x), y, offsets)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        if self.hp.tau == 0.0:
            return None
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)

        def objective(batch: NodeBatch) -> torch.Tensor:
            logits = batch.logits()
            return batch.mean(nll(logits + batch.inputs["offsets"].to(logits.dtype), batch.y))

        return shared.GroupTerm(objective, {"offsets": fedlc_offsets(counts, self.hp.tau)}, key=self.hp)


SPEC = base.AlgorithmSpec(name="fedlc", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
