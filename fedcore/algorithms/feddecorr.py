"""FedDecorr: decorrelating representations against dimensional collapse.

Shi, Liang, Zhang, Tan and Bai, "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023, https://arxiv.org/abs/2210.00226; code
https://github.com/bytedance/FedDecorr (``loss.py``, ``approach/fedavg.py``, ``run_scripts/``).
A node starts from the global model and minimises, per mini-batch,

    L = CE(w; x, y) + beta L_FedDecorr(w; x)
    L_FedDecorr = (1 / d^2) ||K||_F^2

where K is the d x d correlation matrix of the batch's representations: each of the d feature
columns z-scored over the batch, K = Z^T Z / N. The representation is the input of the classifier
(the code's ``return_features``: pooled features before the last linear layer), here
``model.extract(x).flatten(1)`` (the "features" tap). The coordinator is FedAvg's
(sample-weighted average through `self.average`). (Restated from the authors' code and the paper's
method section; the paper is not in the repository, so no equation numbers are given.)

Paper vs code (`form`):
- "code" (default): the authors' ``FedDecorrLoss``: columns centred and divided by
  sqrt(eps + unbiased variance) (eps = 1e-8), M = Z^T Z (not divided by N), and the loss is the
  mean of the squared *off-diagonal* entries of M, divided by N. This is (N - 1)^2 / N times the
  mean squared off-diagonal correlation, so it grows with the batch size. The paper's numbers come
  from it, and so, presumably, do the FedDecorr baselines of FedRCL (beta = 0.01) and FedACD.
- "paper": the paper's formula literally: population z-scores (sqrt(eps + biased variance)),
  K = Z^T Z / N, ||K||_F^2 / d^2 (the diagonal, 1 per feature, included: a constant d / d^2).
- Both are 0 for a batch of one sample, as in the code (no correlation to estimate).
- ``beta = 0`` trains exactly as FedAvg does (the term is skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, functional_method, nll

FORMS = ("code", "paper")
TensorFn = Callable[[torch.Tensor], torch.Tensor]
"""A bound ``extract`` or ``classify``."""
EPS = 1e-8
"""Added to the variance before the square root (the code's ``self.eps``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    beta: float = 0.1
    """Weight of the decorrelation loss, non-negative (the authors' code and run scripts: 0.1; FedRCL's table: 0.01)."""
    form: str = "code"
    """"code": the authors' off-diagonal loss (the published numbers); "paper": ||K||_F^2 / d^2 as in the paper."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "beta")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {self.form!r}")


def decorrelation_loss(features: torch.Tensor, form: str = "code") -> torch.Tensor:
    """L_FedDecorr of a (N, d) batch of features, in the `form` chosen (see the module docstring)."""
    n, d = features.shape
    if n == 1:
        return features.sum() * 0.0  # no correlation from one sample (the code returns 0)
    centred = features - features.mean(dim=0, keepdim=True)
    if form == "paper":
        # z-scores with the population variance; K = Z^T Z / N is the correlation matrix; ||K||_F^2 / d^2
        z = centred / torch.sqrt(EPS + centred.pow(2).mean(dim=0, keepdim=True))
        k = z.t() @ z / n
        return k.pow(2).sum() / d**2
    if form != "code":
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    # the authors' FedDecorrLoss: mean over off-diagonal entries of (Z^T Z)^2, divided by N
    z = centred / torch.sqrt(EPS + centred.var(dim=0, keepdim=True))
    m = z.t() @ z
    off_diagonal = m[~torch.eye(d, dtype=torch.bool, device=m.device)]
    return off_diagonal.pow(2).mean() / n


def weighted_decorrelation_loss(
    features: torch.Tensor, weight: torch.Tensor, count: torch.Tensor, form: str = "code"
) -> torch.Tensor:
    """`decorrelation_loss` of the rows whose `weight` is 1 (a padded batch: padding rows weigh 0), with
    `count` real rows, in tensor operations only (the group form maps it over nodes). Padding rows are
    zero once centred, so they add nothing to any sum; a batch of one real row gives 0 as the code
    does (its centred row is zero), with no branch."""
    n = count.clamp(min=1)
    w = weight.unsqueeze(1).to(features.dtype)
    d = features.shape[1]
    centred = (features - (features * w).sum(dim=0, keepdim=True) / n) * w
    if form == "paper":
        z = centred / torch.sqrt(EPS + centred.pow(2).sum(dim=0, keepdim=True) / n)
        k = z.t() @ z / n
        return k.pow(2).sum() / d**2
    if form != "code":
        raise ValueError(f"form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    z = centred / torch.sqrt(EPS + centred.pow(2).sum(dim=0, keepdim=True) / (n - 1).clamp(min=1))
    m = z.t() @ z
    off_diagonal = m[~torch.eye(d, dtype=torch.bool, device=m.device)]
    return off_diagonal.pow(2).mean() / n


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        beta, form = self.hp.beta, self.hp.form
        if beta == 0.0:
            return None
        extract, classify = split_model(model, self.node_id, task.round)

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = extract(x)  # forward(x) is classify(extract(x)), bit for bit
            # CE + beta L_FedDecorr(features before the classifier)
            return F.cross_entropy(classify(h), y) + beta * decorrelation_loss(h.flatten(1), form)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        """`objective` on a node's padded batch: the same features (``extract``, then ``classify``), the
        decorrelation over the node's real rows only (`weighted_decorrelation_loss`)."""
        beta, form = self.hp.beta, self.hp.form
        if beta == 0.0:
            return None
        split_model(model, self.node_id, task.round)
        extract, classify = functional_method(model, "extract"), functional_method(model, "classify")

        def objective(batch: NodeBatch) -> torch.Tensor:
            h = extract(batch.params, batch.x)
            assert isinstance(h, torch.Tensor)
            logits = classify(batch.params, h)
            assert isinstance(logits, torch.Tensor)
            decorrelation = weighted_decorrelation_loss(h.flatten(1), batch.weight, batch.count, form)
            return batch.mean(nll(logits, batch.y)) + beta * decorrelation

        return shared.GroupTerm(objective, key=self.hp)


def split_model(model: nn.Module, node_id: str, round: int) -> tuple[TensorFn, TensorFn]:
    """The model's ``extract`` and ``classify``; a model without them is an AlgorithmError."""
    extract, classify = getattr(model, "extract", None), getattr(model, "classify", None)
    if extract is None or classify is None:
        raise AlgorithmError(
            f"FedDecorr needs a model with extract(x) and classify(h), not {type(model).__name__}",
            node_id=node_id,
            round=round,
        )
    return extract, classify


SPEC = base.AlgorithmSpec(name="feddecorr", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
