"""FedVLS: vacant-class distillation and logit suppression for label-skewed federated learning.

Guo, Ding, Liang, He, Wang and Tan, "Exploring Vacant Classes in Label-Skewed Federated Learning",
AAAI 2025, https://arxiv.org/abs/2401.02329; code https://github.com/krumpguo/FedVLS
(``system/flcore/clients/clientvls.py``; spec: fedvls.md). The server is FedAvg's (sample-weighted
average through ``self.average``); each node starts from the global model w^g and minimises, per
mini-batch of size B,

    L = L_cal + lambda L_dis + L_logit                                              (Eq. 6)

with p(c) = n_c / n the node's class prior over its whole training set and O = {c : n_c = 0} its
vacant classes (exactly zero samples; rare classes are not vacant):

    L_cal   = CE(f(x) + log(p + eps), y)                                            (Eq. 2)
    L_dis   = (1/B) sum_b KL( softmax(f(x_b; w^g)[O]) || softmax(f(x_b)[O]) )       (Eq. 3)
    L_logit = sum_c p(c) log( (1/B) sum_b 1(y_b != c) exp(f(x_b)[c]) )             (Eqs. 4-5, paper)

L_dis distils, on every sample whatever its label, the teacher's (the frozen global model's)
distribution restricted to the vacant classes, with temperature 1 and no T^2 factor (A5). It is
exactly zero when the node lacks fewer than two classes (a softmax over one class is 1), so the
teacher is not even run then (A4). The label histogram never leaves the node: the update carries
the model, the loss and the step count, as FedAvg's.

Paper vs code, and choices (fedvls.md sections 5 and 7):
- `logit_suppression` (A1): "official" (default, the published numbers) is the code's
  ``new_LADEloss``: with a[b, c] = f(x_b)[c] - log(p(c) + eps) + log(1/K + eps) and
  m[b, c] = 1(y_b != c), L_logit = sum_c p(c) (logsumexp_b(a[b, c] m[b, c]) - log B): the entries
  of class c's own samples are zero-filled (they add exp(0) = 1), not excluded. "paper" is Eqs. 4-5;
  a class that every sample of the batch belongs to is left out of that batch's sum (its log-mean
  would be log 0). Both are multiplied by `logit_scale`: 0.005 in the code, 1 in the paper, so a
  paper-literal run sets ``logit_suppression: paper, logit_scale: 1``. Averaging the paper's sum
  over the samples with y != c instead of over B only shifts the loss by a constant per batch.
- `calibration` (A2): "prior" (default) is Eq. 2 as the code computes it (eps = `prior_eps`,
  1e-9: a vacant class's logit is lowered by about 20.7); "fedlc" replaces it by FedLC's
  CE(f(x) - tau n_c^{-1/4}, y) with tau = `fedlc_tau` (the base of the paper's Table 5 ablation and
  Table 6's "FedLC + FedVLS" rows appear to be FedLC); "none" is plain cross-entropy.
- `teacher_bn` (A6): the code deep-copies the global model while it is in train mode, so the
  teacher's BatchNorm layers normalise with the batch's statistics ("batch", the default); "running"
  uses the aggregated running statistics (eval mode). Any other layer of the teacher (dropout) is in
  eval mode either way. The teacher is the received global model loaded into a spare module of the
  process (``task.scratch``), run under ``no_grad`` (the code runs it with autograd and detaches:
  same values).
- `aggregation` (A8): "participants" (default, the code) normalises the weights over the round's
  updates, as FedAvg; "total" is Algorithm 1, w^{t+1} = w^t + sum_i (n_i / |D|)(w_i - w^t), i.e.
  the previous global model keeps the weight 1 - sum_i n_i / |D|. |D| is the data of every node the
  coordinator has accepted an update from so far (the participation record); the two coincide when
  every node takes part. With another averaging rule (``method.aggregator``) the previous global
  model enters it as one more input.
- Weight decay (A7) is the run's ``train.weight_decay``: the code hard-codes 0 for FedVLS, the paper
  says 1e-5 (MNIST, CIFAR-10) / 1e-4 (CIFAR-100, Tiny-ImageNet). The optimiser is re-created every
  round, as in the code (A9), and the learning rate is the run's (constant in the paper).
- The prior and vacant set come from the whole local training set (A3), recomputed every round
  (the shard is static; the code computes them once).
- ``calibration: none, lam: 0, logit_scale: 0`` trains exactly as FedAvg does (every term skipped).

Group form (`NodeHalf.group_term`, `fedcore.vectorized`): the same loss as a pure function of a node's
padded batch. Each member's offsets, prior and vacant set are its own tensors (`GroupTerm.inputs`);
the teacher is the global model every member started from (`NodeBatch.start`). What `train` decides
per node with Python branches is a mask or a factor here: the vacant set is a class mask (the KL over
O is the softmax over the masked logits), a node with |O| < 2 gets its L_dis times 0 (computed on
every class, so that it stays finite), and L_logit's sums over the batch leave the padding rows out
(log B is the log of the node's real batch size).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.algorithms.fedlc import calibrated_cross_entropy, fedlc_offsets
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.training import LossFn
from fedmq.fedcore.vectorized import NodeBatch, nll, weighted_sum

LOGIT_SUPPRESSIONS = ("official", "paper")
CALIBRATIONS = ("prior", "fedlc", "none")
TEACHER_BN = ("batch", "running")
AGGREGATIONS = ("participants", "total")
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def _choice(hp: object, name: str, allowed: Sequence[str]) -> None:
    value = getattr(hp, name)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    lam: float = 0.1
    """lambda, weight of the vacant-class distillation L_dis, non-negative (paper: 0.1 for MNIST and
    CIFAR-10, 0.5 for CIFAR-100 and Tiny-ImageNet; the code's argparse default 1.0 is never used)."""
    logit_suppression: str = "official"
    """Form of L_logit: "official" (the code's LADE-style term, default) or "paper" (Eqs. 4-5)."""
    logit_scale: float = 0.005
    """Multiplier on L_logit, non-negative (code: 0.005, default; paper: 1); 0 drops the term."""
    calibration: str = "prior"
    """Base loss: "prior" (Eq. 2, CE on f(x) + log(p + eps), default), "fedlc" (FedLC's tau n^{-1/4}
    margins) or "none" (plain cross-entropy)."""
    prior_eps: float = 1e-9
    """eps added to the prior before its log in Eq. 2 and in the official L_logit, positive (code: 1e-9)."""
    fedlc_tau: float = 0.5
    """FedLC's tau, non-negative, used only with calibration "fedlc" (FedVLS's Table 10: 0.5)."""
    teacher_bn: str = "batch"
    """Teacher BatchNorm: "batch" statistics (the code's train-mode copy, default) or "running" (eval mode)."""
    aggregation: str = "participants"
    """Server weights n_i normalised over the round's "participants" (code, default) or over the
    "total" data |D| with the rest kept on the previous global model (Algorithm 1)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "lam", "logit_scale", "fedlc_tau")
        base.require_positive(self, "prior_eps")
        _choice(self, "logit_suppression", LOGIT_SUPPRESSIONS)
        _choice(self, "calibration", CALIBRATIONS)
        _choice(self, "teacher_bn", TEACHER_BN)
        _choice(self, "aggregation", AGGREGATIONS)


def prior_offsets(counts: torch.Tensor, eps: float) -> torch.Tensor:
    """log(p(c) + eps) with p(c) = n_c / n: the offsets of Eq. 2's calibrated logits."""
    return torch.log(counts / counts.sum() + eps)


def vacant_classes(counts: torch.Tensor) -> torch.Tensor:
    """O = {c : n_c = 0}, the indices of the classes the node has no sample of."""
    return torch.nonzero(counts == 0).flatten()


def vacant_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, vacant: torch.Tensor
) -> torch.Tensor:
    """L_dis (Eq. 3): KL(softmax(teacher[:, O]) || softmax(student[:, O])), summed over O, averaged
    over the batch, temperature 1. Exactly 0 when |O| < 2."""
    if vacant.numel() < 2:
        return torch.zeros((), dtype=student_logits.dtype, device=student_logits.device)
    return F.kl_div(
        F.log_softmax(student_logits[:, vacant], dim=1),
        F.log_softmax(teacher_logits[:, vacant], dim=1),
        reduction="batchmean",
        log_target=True,
    )


def logit_suppression_official(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, eps: float) -> torch.Tensor:
    """The code's L_logit before its 0.005 scale: sum_c p(c) (logsumexp_b(a[b, c] m[b, c]) - log B),
    a = f - log(p + eps) + log(1/K + eps), m[b, c] = 1(y_b != c) (masked entries count as exp(0))."""
    batch, classes = logits.shape
    adjusted = logits - torch.log(prior + eps) + math.log(1.0 / classes + eps)
    mask = (y[:, None] != torch.arange(classes, device=y.device)[None, :]).to(logits.dtype)
    spread = torch.logsumexp(adjusted * mask, dim=0) - math.log(batch)
    return (prior * spread).sum()


def logit_suppression_paper(logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """Eqs. 4-5: sum_c p(c) log((1/B) sum_b 1(y_b != c) exp(f(x_b)[c])); a class with no sample of
    another label in the batch is left out (its term would be log 0)."""
    batch, classes = logits.shape
    others = y[:, None] != torch.arange(classes, device=y.device)[None, :]
    has_others = others.any(dim=0)
    # -inf drops a sample of class c from class c's sum; a column with no other sample is filled with
    # zeros instead, so that its (discarded) logsumexp and its gradient stay finite
    fill = torch.where(has_others, float("-inf"), 0.0).to(logits.dtype)
    masked = torch.where(others, logits, fill[None, :])
    per_class = torch.logsumexp(masked, dim=0) - math.log(batch)
    return (prior * torch.where(has_others, per_class, torch.zeros_like(per_class))).sum()


def logit_suppression(
    logits: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, form: str, eps: float
) -> torch.Tensor:
    """L_logit in the chosen form ("official" or "paper"), unscaled."""
    if form == "official":
        return logit_suppression_official(logits, y, prior, eps)
    if form == "paper":
        return logit_suppression_paper(logits, y, prior)
    raise ValueError(f"logit_suppression must be one of {', '.join(map(repr, LOGIT_SUPPRESSIONS))}, got {form!r}")


def set_teacher_mode(teacher: nn.Module, bn: str) -> None:
    """Eval mode, except BatchNorm layers in train mode (batch statistics) when `bn` is "batch"."""
    teacher.eval()
    if bn == "batch":
        for module in teacher.modules():
            if isinstance(module, _BATCH_NORMS):
                module.train()


class CoordinatorHalf(shared.AveragingCoordinator[Hyperparams]):
    """Async mode: "total" aggregation folds the buffer with the previous model as one more input of
    weight 1 - sum_i n_i / |D| (a node with two updates in one buffer counts its n_i twice among the
    inputs and once in |D|); "participants" is FedAvg's."""

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        if self.hp.aggregation == "participants":
            return super().aggregate(ctx, updates, failures)
        samples = [float(u.num_samples) for u in updates]
        sizes = {node.node_id: float(node.num_samples) for node in ctx.participation}
        sizes.update({u.node_id: float(u.num_samples) for u in updates})
        total = math.fsum(sizes.values())
        rest = total - math.fsum(sizes[node] for node in {u.node_id: None for u in updates})
        inputs = list(updates)
        weights = list(samples)
        if rest > 0:
            # w^{t+1} = w^t + sum_i (n_i / |D|)(w_i - w^t) = (1 - sum_i n_i / |D|) w^t + sum_i (n_i / |D|) w_i:
            # w^t enters as one more input, fresh and trained from itself (a zero delta under the async rules)
            current = base.NodeUpdate(
                node_id="(global model)",
                round=ctx.round,
                num_samples=0,
                payload=base.Payload(tensors={"model": self.model.state_dict()}),
                base_version=ctx.version,
            )
            inputs = [current, *inputs]
            weights = [rest, *weights]
        self.model.load_state_dict(self.next_model(ctx, inputs, weights))
        return {
            "train_loss": shared.mean_reported_loss(updates, samples),
            "global_share": rest / total if total > 0 else 0.0,
        }


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        hp = self.hp
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)
        prior = counts / counts.sum()
        vacant = vacant_classes(counts)
        offsets = self._offsets(counts)
        distill = hp.lam > 0.0 and vacant.numel() >= 2  # L_dis is exactly 0 for |O| < 2
        suppress = hp.logit_scale > 0.0
        if offsets is None and not distill and not suppress:
            return None
        teacher = None
        if distill:
            teacher = task.scratch("fedvls-teacher")
            shared.load_group(task, "model", teacher, node_id=self.node_id)  # frozen w^g
            set_teacher_mode(teacher, hp.teacher_bn)

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = m(x)
            # L_cal (Eq. 2, or FedLC's margins, or plain CE)
            loss = F.cross_entropy(logits, y) if offsets is None else calibrated_cross_entropy(logits, y, offsets)
            if suppress:  # + L_logit (Eqs. 4-5, or the code's form), times its scale
                loss = loss + hp.logit_scale * logit_suppression(logits, y, prior, hp.logit_suppression, hp.prior_eps)
            if teacher is not None:  # + lambda L_dis (Eq. 3)
                with torch.no_grad():
                    teacher_logits = teacher(x)
                loss = loss + hp.lam * vacant_distillation(logits, teacher_logits, vacant)
            return loss

        return objective

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        hp = self.hp
        if hp.calibration == "none" and hp.lam == 0.0 and hp.logit_scale == 0.0:
            return None  # FedAvg's cross-entropy for every node, as `objective` gives then
        counts = shared.local_label_counts(data, model, node_id=self.node_id, round=task.round)
        offsets = self._offsets(counts)
        distill = vacant_classes(counts).numel() >= 2
        inputs = {
            "offsets": torch.zeros_like(counts) if offsets is None else offsets,  # logits + 0 is the logits
            "prior": counts / counts.sum(),
            "vacant": counts == 0 if distill else torch.ones_like(counts, dtype=torch.bool),
            "distill": torch.tensor(1.0 if distill else 0.0, dtype=counts.dtype),
        }
        eps, form = hp.prior_eps, hp.logit_suppression

        def objective(batch: NodeBatch) -> torch.Tensor:
            logits = batch.logits()
            node = batch.inputs
            loss = batch.mean(nll(logits + node["offsets"].to(logits.dtype), batch.y))  # L_cal
            if hp.logit_scale > 0.0:  # + L_logit, over the real rows of the batch
                real = (batch.weight > 0) | (batch.weight == 0).all()  # a node with no batch left: all, finite
                suppression = _group_suppression(logits, batch.y, real, batch.count, node, eps, form)
                loss = weighted_sum(loss, (hp.logit_scale, suppression))
            if hp.lam > 0.0:  # + lambda L_dis, the teacher being the global model
                teacher = batch.step["global_logits"]
                kl = batch.mean(_vacant_kl(logits, teacher, node["vacant"]))
                loss = weighted_sum(loss, (hp.lam, node["distill"].to(logits.dtype) * kl))
            return loss

        # the global model's logits on each step's batch, made before the steps (the workspace holds it)
        outputs = {"global_logits": shared.frozen_output(model, data)} if hp.lam > 0.0 else {}
        return shared.GroupTerm(objective, inputs, key=self.hp, outputs=outputs)

    def _offsets(self, counts: torch.Tensor) -> torch.Tensor | None:
        """The per-class offsets of the base loss; None for plain cross-entropy."""
        if self.hp.calibration == "prior":
            return prior_offsets(counts, self.hp.prior_eps)
        if self.hp.calibration == "fedlc":
            return fedlc_offsets(counts, self.hp.fedlc_tau)
        return None


def _vacant_kl(student: torch.Tensor, teacher: torch.Tensor, vacant: torch.Tensor) -> torch.Tensor:
    """Each sample's KL(softmax(teacher[O]) || softmax(student[O])) with O the classes of the mask
    `vacant`: `vacant_distillation` before its batch mean, with no indexing by a per-node set. The
    log-probabilities of the other classes (-inf) are replaced by 0 before they meet, so that no NaN
    enters the forward or the backward pass."""
    s = F.log_softmax(student.masked_fill(~vacant, float("-inf")), dim=-1)
    t = F.log_softmax(teacher.masked_fill(~vacant, float("-inf")), dim=-1)
    s, t = torch.where(vacant, s, 0.0), torch.where(vacant, t, 0.0)
    return torch.where(vacant, t.exp() * (t - s), 0.0).sum(-1)


def _group_suppression(
    logits: torch.Tensor,
    y: torch.Tensor,
    real: torch.Tensor,
    count: torch.Tensor,
    node: Mapping[str, torch.Tensor],
    eps: float,
    form: str,
) -> torch.Tensor:
    """`logit_suppression` over the rows `real` of a padded batch (`count` of them): a padding row
    is left out of every class's sum over the batch, as a row the batch does not have."""
    classes = logits.shape[-1]
    prior = node["prior"]
    others = y[:, None] != torch.arange(classes, device=y.device)[None, :]
    if form == "official":
        adjusted = logits - torch.log(prior + eps) + math.log(1.0 / classes + eps)
        entries = torch.where(real[:, None], adjusted * others.to(logits.dtype), float("-inf"))
        return (prior * (torch.logsumexp(entries, dim=0) - torch.log(count))).sum()
    others = others & real[:, None]
    has_others = others.any(dim=0)
    fill = torch.where(has_others, float("-inf"), 0.0).to(logits.dtype)
    per_class = torch.logsumexp(torch.where(others, logits, fill[None, :]), dim=0) - torch.log(count)
    return (prior * torch.where(has_others, per_class, torch.zeros_like(per_class))).sum()


SPEC = base.AlgorithmSpec(name="fedvls", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
