"""FedNTD: federated not-true distillation.

Lee, Jeong, Shin, Bae and Yun, "Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning", NeurIPS 2022, https://arxiv.org/abs/2106.03097; code
https://github.com/Lee-Gihun/FedNTD (``algorithms/fedntd/criterion.py``, ``config/fedntd.json``).
A node starts from the global model w^t and minimises, per mini-batch,

    L = CE(q^l, y) + beta L_NTD(q~^l_tau, q~^g_tau)                               (the local objective)
    L_NTD = - sum_{c != y} q~^g_tau(c) log( q~^l_tau(c) / q~^g_tau(c) )             (not-true distillation)

where q~_tau is the softmax at temperature tau over the *not-true* logits (the logit of the sample's
own label removed, the other C - 1 kept in order), of the local model (l) and of the frozen global
model (g). L_NTD is KL(q~^g || q~^l), summed over the C - 1 classes and averaged over the batch (the
code's ``KLDivLoss(reduction="batchmean")``). The global model runs in a spare module
(`TaskInput.scratch`) in eval mode, without gradients. The coordinator is FedAvg's (sample-weighted
average through `self.average`).

The paper is not in the repository: the equations are restated from the authors' code and the
paper's method section, without equation numbers (not checked against the text).

Paper vs code, and choices:
- Temperature: the code's ``NTD_Loss`` has a default tau = 3 that ``config/fedntd.json`` (the
  published setup) overrides with tau = 1 and beta = 1; the defaults here are those.
- KD scale (`kd_scale`): "plain" (default) is beta KL, as the paper's objective and the authors' code
  compute it; "tau2" is beta tau^2 KL, the Hinton scaling that FedVLS's baseline code
  (``clientntd.py``) adds. At tau = 1 the two are identical. (FedVLS's code also reads tau from its
  ``--tau`` flag, whose default 0.001 belongs to FedAdam; that is not reproduced.)
- Teacher mode: eval mode (BatchNorm with the aggregated running statistics). The authors' code
  deep-copies the model after evaluating it, so its teacher is in eval mode from round 1 on.
- ``beta = 0`` trains exactly as FedAvg does (no teacher is loaded, the term is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, nll, weighted_sum

KD_SCALES = ("plain", "tau2")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    beta: float = 1.0
    """Weight of the not-true distillation term, non-negative (paper and code: 1; FedVLS's table 0.1, FedRCL's 0.3)."""
    temperature: float = 1.0
    """Softmax temperature tau of the not-true distillation, positive (code's config/fedntd.json: 1)."""
    kd_scale: str = "plain"
    """"plain": beta KL (the paper and the authors' code); "tau2": beta tau^2 KL (FedVLS's baseline code)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "beta")
        base.require_positive(self, "temperature")
        if self.kd_scale not in KD_SCALES:
            raise ValueError(f"kd_scale must be one of {', '.join(map(repr, KD_SCALES))}, got {self.kd_scale!r}")

    @property
    def kd_weight(self) -> float:
        """The factor in front of the batch-mean not-true KL."""
        return self.beta * (self.temperature**2 if self.kd_scale == "tau2" else 1.0)


def not_true_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The (B, C - 1) logits with each row's true-class entry removed, the others kept in order
    (the code's ``refine_as_not_true``)."""
    batch, classes = logits.shape
    keep = torch.ones_like(logits, dtype=torch.bool)
    keep[torch.arange(batch, device=logits.device), targets] = False
    return logits[keep].view(batch, classes - 1)


def ntd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """L_NTD: KL(q~^g_tau || q~^l_tau) over the not-true classes, averaged over the batch."""
    student = not_true_logits(student_logits, targets)
    teacher = not_true_logits(teacher_logits.detach(), targets)
    return F.kl_div(
        F.log_softmax(student / temperature, dim=1),
        F.log_softmax(teacher / temperature, dim=1),
        reduction="batchmean",
        log_target=True,
    )


def not_true_per_sample(student: torch.Tensor, teacher: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """Each sample's KL(q~^g_tau || q~^l_tau) over its not-true classes: `ntd_loss` before the batch
    mean, with the true class left out by a gather (a fixed shape, which a map over nodes needs)
    instead of a boolean mask."""
    classes = student.shape[-1]
    others = torch.arange(classes - 1, device=student.device)
    keep = others + (others >= y.unsqueeze(-1)).long()  # (B, C - 1): every class but the true one, in order
    s = F.log_softmax(student.gather(-1, keep) / tau, dim=-1)
    t = F.log_softmax(teacher.detach().gather(-1, keep) / tau, dim=-1)
    return (t.exp() * (t - s)).sum(-1)


CoordinatorHalf = shared.AveragingCoordinator
"""FedAvg's server: the global model is the sample-weighted average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        if self.hp.beta == 0.0:
            return None
        teacher = shared.frozen_model(task, "fedntd-global", "model", node_id=self.node_id)  # the global model w^t
        weight, tau = self.hp.kd_weight, self.hp.temperature

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = m(x)
            with torch.no_grad():
                teacher_logits = teacher(x)
            # CE(q^l, y) + beta L_NTD(q~^l_tau, q~^g_tau)     [x tau^2 with kd_scale "tau2"]
            return F.cross_entropy(logits, y) + weight * ntd_loss(logits, teacher_logits, y, tau)

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        if self.hp.beta == 0.0:
            return None
        weight, tau = self.hp.kd_weight, self.hp.temperature
        # the global model w^t's logits on each step's batch, made before the steps (the workspace holds w^t)
        outputs = {"global_logits": shared.frozen_output(model, data)}

        def objective(batch: NodeBatch) -> torch.Tensor:
            logits = batch.logits()
            ntd = not_true_per_sample(logits, batch.step["global_logits"], batch.y, tau)
            return batch.mean(weighted_sum(nll(logits, batch.y), (weight, ntd)))

        return shared.GroupTerm(objective, key=self.hp, outputs=outputs)


SPEC = base.AlgorithmSpec(name="fedntd", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
