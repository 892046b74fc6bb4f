"""FedACD: federated learning with adaptability over client distributions.

Zhou, Ding, Li and Wang, "Enhancing the Performance of Global Model by Improving the Adaptability
of Local Models in Federated Learning", arXiv 2025, https://arxiv.org/abs/2505.10125. The paper names
no code (the only public "FedACD" repository is an unrelated MATLAB project), so every gap below is
filled with the spec's recommendation (``specs/fedacd.md`` section 5), each an option.

A node trains its local model towards equal class-wise errors, through its C x C class-probability
matrix P (row i: the mean softmax vector of the node's class-i samples, so eps_i = 1 - P_ii):

    L1 = mean_(x,y) KL(p || q),  q_y = p_y,  q_k = (1 - p_y) / (C - 1) for k != y        (Eq. 7)
    L2 = mean_(x,y) CE(f + log Delta_y., y),  Delta_yi = P_yi / P_iy                      (Eq. 8)
    L  = L1 + lambda L2                                                                  (Eq. 9)

L1 flattens each sample's wrong-class probabilities (then the rows of P have flat off-diagonals),
L2 is Menon et al.'s logit adjustment with the pairwise ratio Delta, which pushes P towards symmetry;
together they make the diagonal of P constant. Input Mixup (Zhang et al. 2018) is applied to every
local mini-batch. After training the node computes its adaptability score

    Q_ii = tau,  Q_ij = (1 - tau) / (C - 1)                                              (Eq. 10)
    V_m = Sigmoid(1 / KL(P^m || Q))

and sends it with its model (meta ``score``; P and the node's label histogram stay on the node).
The coordinator averages the models with weights V_m / sum_k V_k (Eq. 11), through `self.average`.

Choices (spec section 5; each an option defaulting to the recommendation):
- P during training (`p_estimate`, ambiguity 1): "running" (default) starts from one no-grad pass of
  the received global model over the clean local data (no augmentation, no Mixup, eval mode), then
  after every local epoch becomes the mean of that epoch's detached softmax outputs, a mixed sample
  counting lam towards row y_a and 1 - lam towards row y_b; a row that got no weight in the epoch
  keeps its previous value. "clean": a clean no-grad pass at the start of every epoch instead.
- P for the score (ambiguity 2): one clean no-grad pass of the final local model (eval mode).
- KL(P || Q) (`kl_reduction`, ambiguities 3, 4): "mean" (default) over the node's present classes of
  the per-row KL, the only reading that fits the paper's Table 9 (0.6 to 5.6 on CIFAR-100); "sum" is
  Eq. 10's literal double sum over the present rows. Rows of absent classes are left out (no data).
- Missing classes (`delta_missing`, ambiguity 5): Delta_yk = 1e-2 for a class k the node lacks
  (the paper's "small value"); Delta_yy = 1. Entries of P are clamped to `eps` (1e-8) before the log
  (ambiguity 6); `log_delta_clip` > 0 additionally clips log Delta to [-clip, clip] (off by default).
- q in L1 (`detach_target`, ambiguity 7): a constant target (stop-gradient) by default; false lets the
  gradient flow through q, which makes L1 = (1 - p_y) KL(p~ || U_{C-1}) with p~ the renormalised
  non-target distribution. Delta in L2 is always a constant.
- Mixup with two labels (ambiguity 8): l = lam l(x~, y_a) + (1 - lam) l(x~, y_b), both L1 and L2.
  lam ~ Beta(alpha, alpha), alpha = `mixup_alpha` (ambiguity 9; 1.0, the mixup paper's CIFAR
  setting; 0 turns Mixup off and draws nothing), the partner of each sample from a permutation of
  its batch. torch cannot sample a Beta from a `torch.Generator` (``torch._standard_gamma`` takes
  none), so each `train` call seeds a numpy Generator (PCG64) with one 63-bit integer drawn from the
  node's generator and draws every lam of the call from it; the permutations come from the torch
  generator itself. Mixup is applied after the dataset's own augmentation and normalisation.
- No plain CE term is added (ambiguity 10): L = L1 + lambda L2 exactly.
- Weights (`weighting`, ambiguity 11 and Table 8): "score" (default, Eq. 11: V_m alone), "score_samples"
  (V_m n_m), "uniform" (the paper's FedACD_base ablation), "samples" (FedAvg's n_m).
- Buffers (ambiguity 13): averaged with the same weights by `self.average`, integer buffers take the
  maximum (the framework's rule).
- The learning-rate schedule, client sampling and evaluation protocols (ambiguities 12, 14 to 16) are
  the experiment's business, not this module's.
- V_m when KL -> 0 (ambiguity 17): 1 / max(KL, eps), so V saturates at 1.

Beyond the paper, for ablations and the FedAvg check: `l1_weight` (1 in Eq. 9) scales L1 and 0 drops
it; `logit_adjust` false replaces L2 by plain CE. With l1_weight = 0, logit_adjust = false,
l2_weight = 1, mixup_alpha = 0 and weighting = "samples", FedACD trains and aggregates exactly as
FedAvg does (the terms are skipped, and no random number is drawn beyond FedAvg's).

Group form (`NodeHalf.train_group`, `fedcore.vectorized`): Eq. 9 as a pure function of each node's
batch, its Mixup draws (the numpy seed first, then each batch's lam and permutation) drawn into the
plan in the order `train` draws them, each member's score from its own trained model. With log Delta
and the running P (the paper's setting and the default), each node's P, log Delta, its row sums and
their weights are the vectorised step's carried state (`train_vectorized`'s `carry`): renewed between
steps before each epoch but the first (`train_vectorized`'s `epoch_start`, `_RenewedRows`), read as
log Delta, and fed with the step's detached outputs, as `_Estimate` does in `train`. With
``p_estimate: clean`` the carried state is P and log Delta, renewed at the same points by a clean pass
of the node's model as it then is over its whole shard (`_CleanP`). A step computes each mixed sample's
loss for its two labels as one batch of twice the rows (`train_group`'s objective).

The coordinator never trusts the wire: a score that is missing, not a finite number or outside
(0.5, 1] (the range of Sigmoid(1 / KL) for KL >= 0) leaves its update out of a score-weighted average,
with a warning and the metric ``acd_invalid``; if no update is left the round fails with
AlgorithmError. The metric ``acd_kl`` is the mean KL(P || Q) over the valid scores, recovered as
1 / logit(V_m) (no extra value travels); it is what the paper's Table 9 reports.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.training import TrainSettings, autocast, local_sgd
from fedmq.fedcore.vectorized import (
    NodeBatch,
    nll,
    steps_per_epoch,
    take_rows,
    train_vectorized,
    unsupported,
    weighted_sum,
)

logger = logging.getLogger(__name__)

SCORE = "score"
"""The update meta key that carries V_m."""
P_ESTIMATES = ("running", "clean")
KL_REDUCTIONS = ("mean", "sum")
WEIGHTINGS = ("score", "score_samples", "uniform", "samples")
_PASS_BATCH = 1024
"""Batch size of the clean no-grad passes that estimate P (no effect on the result)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    l2_weight: float = 1.0
    """lambda of Eq. 9, the weight of the adjusted cross-entropy L2, non-negative (paper: 1; Table 7 sweeps 0.5-2)."""
    l1_weight: float = 1.0
    """Weight of the flattening loss L1, non-negative (Eq. 9 has 1; 0 drops L1, not a paper setting)."""
    logit_adjust: bool = True
    """Add log Delta to the logits in L2 (Eq. 8, paper); false gives plain CE (not a paper setting)."""
    tau: float = 1.0 - 1e-5
    """Diagonal of the template Q (Eq. 10), in (0, 1) (paper: 1 - 1e-5)."""
    mixup_alpha: float = 1.0
    """Mixup's Beta(alpha, alpha) parameter, non-negative; 0 is no Mixup (paper: Mixup, alpha not given; spec: 1)."""
    delta_missing: float = 1e-2
    """Delta_yk for a class k the node lacks, positive (paper: "a small value"; spec: 1e-2, sweep 1e-4 to 1e-1)."""
    eps: float = 1e-8
    """Floor on the entries of P in log Delta and on KL in 1 / KL, in (0, 1) (spec: 1e-8)."""
    log_delta_clip: float = 0.0
    """Clip log Delta to [-clip, clip] when positive; 0 is off, non-negative (spec: off, optionally 10)."""
    detach_target: bool = True
    """Treat q in L1 as a constant target (spec: yes, the paper calls q a target vector)."""
    p_estimate: str = "running"
    """P in training: "running" (mean over the previous epoch's batches, spec) or "clean" (a clean pass per epoch)."""
    kl_reduction: str = "mean"
    """KL(P || Q) as the "mean" over the present classes' rows (spec, fits Table 9) or the literal "sum" of Eq. 10."""
    weighting: str = "score"
    """Aggregation weights: "score" (Eq. 11), "score_samples" (V n), "uniform" (Table 8 base), "samples" (FedAvg)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "l1_weight", "l2_weight", "mixup_alpha", "log_delta_clip")
        base.require_positive(self, "delta_missing", "eps")
        if self.l1_weight == 0.0 and self.l2_weight == 0.0:
            raise ValueError("l1_weight and l2_weight must not both be 0 (the local loss would be 0)")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must be in (0, 1), got {self.tau!r}")
        if not self.eps < 1.0:
            raise ValueError(f"eps must be in (0, 1), got {self.eps!r}")
        for name, allowed in (
            ("p_estimate", P_ESTIMATES),
            ("kl_reduction", KL_REDUCTIONS),
            ("weighting", WEIGHTINGS),
        ):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


# -- the local loss (Eqs. 7-9) -------------------------------------------------------------------


def flatten_loss(
    logits: torch.Tensor, y: torch.Tensor, *, detach_target: bool = True, target: torch.Tensor | None = None
) -> torch.Tensor:
    """L1 per sample (Eq. 7): KL(p || q) with q_y = p_y and q_k = (1 - p_y) / (C - 1) for k != y.

    The k = y term is 0, so L1 = sum_{k != y} p_k (log p_k - log q_k), with the stable
    log(1 - p_y) = logsumexp_{k != y} f_k - logsumexp_k f_k. Shape (B,). `target`: y as a (B, C) mask
    over the classes, where the caller has it.
    """
    num_classes = logits.shape[1]
    log_p = F.log_softmax(logits, dim=1)
    if target is None:  # the one-hot mask as one comparison (F.one_hot's own: a comparison, then two casts, under vmap)
        target = y.unsqueeze(-1) == torch.arange(num_classes, device=y.device)
    log_rest = torch.logsumexp(logits.masked_fill(target, -math.inf), dim=1) - torch.logsumexp(logits, dim=1)
    log_q = (log_rest - math.log(num_classes - 1)).unsqueeze(1)  # log q_k for every k != y
    if detach_target:
        log_q = log_q.detach()
    terms = log_p.exp() * (log_p - log_q)
    return terms.masked_fill(target, 0.0).sum(dim=1)


def adjusted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, log_delta: torch.Tensor) -> torch.Tensor:
    """L2 per sample (Eq. 8): log[1 + sum_{i != y} exp(f_i - f_y + log Delta_yi)] = CE(f + log Delta_y., y).

    `log_delta` is the C x C matrix of `log_delta_matrix` (a constant, zero diagonal). Shape (B,).
    """
    return F.cross_entropy(logits + log_delta[y], y, reduction="none")


def local_loss(
    logits: torch.Tensor,
    y: torch.Tensor,
    log_delta: torch.Tensor | None,
    *,
    l1_weight: float,
    l2_weight: float,
    detach_target: bool = True,
) -> torch.Tensor:
    """Eq. 9 averaged over the batch: l1_weight L1 + l2_weight L2; `log_delta` None gives L2 = plain CE.
    A zero weight skips its term."""
    loss: torch.Tensor | None = None
    if l2_weight != 0.0:
        ce = F.cross_entropy(logits, y) if log_delta is None else adjusted_cross_entropy(logits, y, log_delta).mean()
        loss = l2_weight * ce
    if l1_weight != 0.0:
        l1 = l1_weight * flatten_loss(logits, y, detach_target=detach_target).mean()
        loss = l1 if loss is None else loss + l1
    if loss is None:
        raise ValueError("l1_weight and l2_weight are both 0")
    return loss


def log_delta_matrix(
    p: torch.Tensor, present: torch.Tensor, *, delta_missing: float, eps: float, clip: float = 0.0
) -> torch.Tensor:
    """log Delta (C x C) from P: row y, column i is log(max(P_yi, eps)) - log(max(P_iy, eps)) for
    present classes y and i, log(delta_missing) for a missing class i, 0 on the diagonal; rows of
    missing classes are 0 (never used: they are no label). `clip` > 0 clips the result to [-clip, clip]."""
    log_p = torch.log(p.clamp_min(eps))
    out = log_p - log_p.T
    missing_column = (~present).unsqueeze(0).expand_as(out)
    out = torch.where(missing_column, torch.full_like(out, math.log(delta_missing)), out)
    out = torch.where(present.unsqueeze(1), out, torch.zeros_like(out))
    # the diagonal set to 0 without writing in place, so that the vectorised step can map it over nodes
    diagonal = torch.eye(len(out), dtype=torch.bool, device=out.device)
    out = torch.where(diagonal, torch.zeros_like(out), out)
    if clip > 0.0:
        out = out.clamp(-clip, clip)
    return out


# -- Mixup ---------------------------------------------------------------------------------------


def mixup_batch(
    x: torch.Tensor, y: torch.Tensor, lam: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Input Mixup within a batch: (lam x + (1 - lam) x[perm], y[perm]), perm drawn from `generator`;
    lam = 1 returns x itself and draws nothing."""
    if lam == 1.0:
        return x, y
    perm = torch.randperm(len(y), generator=generator, device=generator.device).to(x.device)
    return lam * x + (1.0 - lam) * x[perm], y[perm]


def mixup_lambda(alpha: float, rng: np.random.Generator | None) -> float:
    """lam ~ Beta(alpha, alpha) from the numpy generator `rng`; 1 (no mixing) when alpha is 0."""
    if alpha == 0.0 or rng is None:
        return 1.0
    return float(rng.beta(alpha, alpha))


def numpy_stream(generator: torch.Generator) -> np.random.Generator:
    """A numpy Generator seeded by one 63-bit draw from the torch `generator` (for the Beta draws)."""
    seed = torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device)
    return np.random.Generator(np.random.PCG64(int(seed.item())))


# -- the class-probability matrix and the score (Eq. 10) -----------------------------------------


def accumulate_rows(
    sums: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor, weight: float = 1.0
) -> None:
    """Add `weight` x each probability vector to the row of its label (in place): P_ij = sums_ij / counts_i."""
    shared.add_rows(sums, labels, probs * weight)
    shared.add_rows(counts, labels, torch.full_like(labels, 1, dtype=counts.dtype) * weight)


def accumulated(
    sums: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accumulate_rows` as a pure function with a weight per sample (0 for a vectorised batch's
    padding): the sums and counts after adding each weighted probability vector to its label's row."""
    rows = (labels.unsqueeze(1) == torch.arange(sums.shape[0], device=labels.device)).to(sums.dtype)
    rows = rows * weight.to(sums.dtype).unsqueeze(1)
    return sums + rows.T @ probs.to(sums.dtype), counts + rows.sum(dim=0)


def rows_from(sums: torch.Tensor, counts: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """P from accumulated rows; a row with no weight keeps its `previous` value."""
    has = (counts > 0).unsqueeze(1)
    return torch.where(has, sums / counts.clamp_min(1e-12).unsqueeze(1), previous)


@torch.no_grad()
def probability_matrix(model: nn.Module, data: TensorDataset, *, batch_size: int = _PASS_BATCH) -> torch.Tensor:
    """P over the clean local data (eval transform, no Mixup), the model in eval mode; rows of absent
    classes are 0. The model's train/eval mode is restored."""
    first = next(model.parameters())
    device, dtype = first.device, torch.promote_types(first.dtype, torch.float32)  # float32 or a float64 model's
    num_classes = data.num_classes
    sums = torch.zeros(num_classes, num_classes, device=device, dtype=dtype)
    counts = torch.zeros(num_classes, device=device, dtype=dtype)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(data), batch_size):
            x, y = data.eval_batch(start, start + batch_size)
            x, y = x.to(device), y.to(device)
            accumulate_rows(sums, counts, F.softmax(model(x).to(dtype), dim=1), y)
    finally:
        model.train(was_training)
    return rows_from(sums, counts, torch.zeros_like(sums))


def template_kl(p: torch.Tensor, present: torch.Tensor, *, tau: float, reduction: str = "mean") -> float:
    """KL(P || Q) over the present classes' rows, Q_ii = tau and Q_ij = (1 - tau) / (C - 1) (Eq. 10):
    the mean (spec) or the sum of the rows' sum_j P_ij log(P_ij / Q_ij); 0 log 0 = 0. In float64."""
    if reduction not in KL_REDUCTIONS:
        raise ValueError(f"reduction must be one of {KL_REDUCTIONS}, got {reduction!r}")
    rows = p.double()[present]
    if len(rows) == 0:
        raise ValueError("no present class: KL(P || Q) is undefined")
    num_classes = p.shape[1]
    log_q = torch.full_like(rows, math.log((1.0 - tau) / (num_classes - 1)))
    idx = torch.nonzero(present).squeeze(1)
    log_q[torch.arange(len(idx)), idx] = math.log(tau)
    per_row = (torch.xlogy(rows, rows) - rows * log_q).sum(dim=1)
    return float(per_row.mean() if reduction == "mean" else per_row.sum())


def adaptability_score(kl: float, eps: float) -> float:
    """V = Sigmoid(1 / max(KL, eps)) (Eq. 10), in (0.5, 1]."""
    return 1.0 / (1.0 + math.exp(-1.0 / max(kl, eps)))


def kl_from_score(score: float) -> float:
    """The KL a score V in (0.5, 1] came from: 1 / logit(V); 0 for a saturated V = 1."""
    if score >= 1.0:
        return 0.0
    return 1.0 / math.log(score / (1.0 - score))


# -- aggregation (Eq. 11) ------------------------------------------------------------------------


def aggregation_weights(scores: Sequence[float], num_samples: Sequence[int], weighting: str) -> list[float]:
    """Unnormalised weights of Eq. 11 ("score": V_m) or of its variants ("score_samples": V_m n_m,
    "uniform": 1, "samples": n_m, FedAvg's)."""
    if weighting == "score":
        return [float(v) for v in scores]
    if weighting == "score_samples":
        return [float(v) * float(n) for v, n in zip(scores, num_samples, strict=True)]
    if weighting == "uniform":
        return [1.0] * len(num_samples)
    if weighting == "samples":
        return [float(n) for n in num_samples]
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


class CoordinatorHalf(shared.AveragingCoordinator[Hyperparams]):
    """FedAvg's broadcast; the average is weighted by the nodes' adaptability scores (Eq. 11). Async
    mode: a score is a property of its own update, so a buffer folds with the same weights."""

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        scores = [self._score(u) for u in updates]
        valid_scores = [v for v in scores if v is not None]
        invalid = len(updates) - len(valid_scores)
        kept: list[base.NodeUpdate] = []
        used_scores: list[float] = []
        needs_score = self.hp.weighting in ("score", "score_samples")
        for update, score in zip(updates, scores, strict=True):
            if score is not None or not needs_score:  # an unused score only counts as invalid
                kept.append(update)
                used_scores.append(score if score is not None else 0.0)
        if not kept:
            raise AlgorithmError("no update of this round carries a valid FedACD score", round=ctx.round)
        weights = aggregation_weights(used_scores, [u.num_samples for u in kept], self.hp.weighting)
        # w <- sum_m (V_m / sum_k V_k) w_m   (Eq. 11, or the chosen variant)
        self.model.load_state_dict(self.next_model(ctx, kept, weights))
        nan = float("nan")
        return {
            "train_loss": shared.mean_reported_loss(kept, weights),
            "acd_invalid": float(invalid),
            "acd_score": math.fsum(valid_scores) / len(valid_scores) if valid_scores else nan,
            "acd_kl": math.fsum(map(kl_from_score, valid_scores)) / len(valid_scores) if valid_scores else nan,
        }

    def _score(self, update: base.NodeUpdate) -> float | None:
        """The update's V_m, or None (with a warning) when it is not a number in (0.5, 1]."""
        value = update.payload.meta.get(SCORE)
        score = base.wire_number(value)
        if score is None or not 0.5 < score <= 1.0:
            logger.warning(
                "round %d: update of %s carries no valid FedACD score (%r)", update.round, update.node_id, value
            )
            return None
        return score


class NodeHalf(base.NodeHalf[Hyperparams]):
    """Local training with L1 + lambda L2 (Eq. 9) and Mixup; the update carries V_m in meta ``score``."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        hp = self.hp
        present = self._present(task, data)
        uses_delta = hp.logit_adjust and hp.l2_weight != 0.0
        rng = numpy_stream(generator) if hp.mixup_alpha > 0.0 else None
        l1_weight, l2_weight, detach = hp.l1_weight, hp.l2_weight, hp.detach_target

        if not uses_delta and rng is None:

            def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                return local_loss(m(x), y, None, l1_weight=l1_weight, l2_weight=l2_weight, detach_target=detach)

            stats = local_sgd(model, data, task.settings, generator, loss_fn=objective)
        else:
            state = _Estimate(model, data, present, hp, task.settings) if uses_delta else None

            def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                log_delta = state.before_batch() if state is not None else None
                lam = mixup_lambda(hp.mixup_alpha, rng)
                x, y_b = mixup_batch(x, y, lam, generator)
                logits = m(x)
                # l = lam l(x~, y_a) + (1 - lam) l(x~, y_b), each l = l1_weight L1 + lambda L2 (Eq. 9)
                loss = local_loss(logits, y, log_delta, l1_weight=l1_weight, l2_weight=l2_weight, detach_target=detach)
                if lam != 1.0:
                    loss = lam * loss + (1.0 - lam) * local_loss(
                        logits, y_b, log_delta, l1_weight=l1_weight, l2_weight=l2_weight, detach_target=detach
                    )
                if state is not None:
                    state.after_batch(logits, y, y_b, lam)
                return loss

            stats = local_sgd(model, data, task.settings, generator, loss_fn=objective)
        meta = {"loss": stats.loss, "steps": stats.steps, SCORE: self._score(model, data, present)}
        return base.Payload(tensors={"model": model.state_dict()}, meta=meta)

    def _present(self, task: base.TaskInput, data: TensorDataset) -> torch.Tensor:
        """Which classes the node has (the label histogram stays here: only that is used)."""
        num_classes = data.num_classes
        if num_classes < 2 or len(data) == 0:
            message = f"FedACD needs at least 2 classes and 1 sample, got {num_classes} classes, {len(data)} samples"
            raise AlgorithmError(message, node_id=self.node_id, round=task.round)
        return torch.bincount(data.y, minlength=num_classes).to(data.y.device) > 0

    def _score(self, model: nn.Module, data: TensorDataset, present: torch.Tensor) -> float:
        """V_m from P of the final local model over the clean local data (Eq. 10)."""
        final = probability_matrix(model, data)
        kl = template_kl(final, present.to(final.device), tau=self.hp.tau, reduction=self.hp.kl_reduction)
        return adaptability_score(kl, self.hp.eps)

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once (`group_refusal` says where not): Eq. 9 on each node's batch
        mixed as `train` mixes it (the draws in the plan, `_StepDraws`), with the node's P and log Delta
        carried from step to step, renewed between steps at its epochs' starts (`_RenewedRows`, `_CleanP`)."""
        first = shared.start_group(self, members, model)
        present = [m.half._present(m.task, m.data) for m in members]  # type: ignore[attr-defined]
        hp = self.hp
        uses_delta = hp.logit_adjust and hp.l2_weight != 0.0
        running = uses_delta and hp.p_estimate == "running"
        draws = _StepDraws(hp.mixup_alpha) if hp.mixup_alpha > 0.0 else None
        carry = _start_p(model, members, present, hp, running=running) if uses_delta else {}
        settings = first.task.settings
        renew_p: _CleanP | _RenewedRows | None = None
        if uses_delta:
            datasets = [m.data for m in members]
            renew_p = (
                _RenewedRows(present, hp, settings) if running else _CleanP(model, datasets, present, hp, settings)
            )

        classes = torch.arange(first.data.num_classes, device=next(model.parameters()).device)  # once, not a step

        def objective(
            batch: NodeBatch,
        ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            state = _carried_p(batch) if uses_delta else None
            log_delta = state.log_delta if state is not None else None
            if hp.mixup_alpha == 0.0:
                logits = batch.logits()
                mix, labels = None, batch.y
                target = labels.unsqueeze(1) == classes  # each row's label as a mask over the classes
                loss = batch.mean(_per_sample(logits, labels, target, log_delta, hp))
            else:
                mix, perm = batch.step["mix"][0].to(batch.x.dtype), batch.step["perm"]  # (lam, 1 - lam)
                # x~ = lam x + (1 - lam) x[perm] as one lerp; lam = 1 (no mixing drawn) gives x exactly
                logits = batch.forward(batch.params, torch.lerp(take_rows(batch.x, perm), batch.x, mix[0]))
                # l = lam l(x~, y_a) + (1 - lam) l(x~, y_b), as `train` takes it: both labels' terms as one
                # batch of twice the rows, their two means taken at once, then mixed
                labels = torch.cat([batch.y, take_rows(batch.y, perm)])
                target = labels.unsqueeze(1) == classes
                both = _per_sample(torch.cat([logits, logits]), labels, target, log_delta, hp)
                loss = (batch.means(both.view(2, -1)) * mix).sum()
            if state is None:
                return loss
            return loss, {}, state.fed(logits, target, mix, batch.weight)

        # the objective reads its batch, its members' inputs and carried P, and the hyperparameters (the
        # flags above are theirs): a later round's group may train in this one's kept round
        results = train_vectorized(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members],
            objective=objective, draws=draws, carry=carry, epoch_start=renew_p, keep_as=("fedacd", hp),
        )  # fmt: skip
        payloads = []
        for member, own, (state, stats) in zip(members, present, results, strict=True):
            model.load_state_dict(state)
            score = member.half._score(model, member.data, own)  # type: ignore[attr-defined]
            meta = {"loss": stats.loss, "steps": stats.steps, SCORE: score}
            payloads.append(base.Payload(tensors={"model": state}, meta=meta))
        return payloads

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)


def _epoch_steps(data: TensorDataset, settings: TrainSettings) -> int:
    """The steps of one of `local_sgd`'s epochs over the node's data (at least 1): where P is renewed."""
    return max(steps_per_epoch(len(data), settings.batch_size, settings.drop_last), 1)


def _start_p(
    model: nn.Module,
    members: Sequence[base.GroupMember],
    present: Sequence[torch.Tensor],
    hp: Hyperparams,
    *,
    running: bool,
) -> dict[str, torch.Tensor]:
    """Each member's carried state before its first step, as `_Estimate` starts it: P from a clean pass
    of the received model over its data and log Delta from it, and for the running P empty row sums and
    weights."""
    p = torch.stack([probability_matrix(model, m.data) for m in members])
    state = {"p": p, "log_delta": torch.stack([_log_delta(p[k], own, hp) for k, own in enumerate(present)])}
    return state | {"sums": torch.zeros_like(p), "counts": torch.zeros_like(p[:, 0])} if running else state


def _log_delta(p: torch.Tensor, present: torch.Tensor, hp: Hyperparams) -> torch.Tensor:
    return log_delta_matrix(p, present.to(p.device), delta_missing=hp.delta_missing, eps=hp.eps, clip=hp.log_delta_clip)


class _RenewedRows:
    """``p_estimate: running`` in a group: before each epoch but the first, node k's P from the rows its
    last epoch summed (a row with no weight keeps its value), the sums emptied and log Delta from the new
    P, as `_Estimate` renews them in `train`. Between steps (`train_vectorized`'s epoch_start), so that
    no step recomputes log Delta: before, every step did, about 20 operators, for a P that changes once
    an epoch. The same values, bit for bit (the same operators on each node's slice; under the step's
    autocast)."""

    def __init__(self, present: Sequence[torch.Tensor], hp: Hyperparams, settings: TrainSettings) -> None:
        self.present, self.hp, self.settings = present, hp, settings

    @torch.no_grad()
    def __call__(
        self, k: int, params: dict[str, torch.Tensor], carried: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        sums, counts = carried["sums"], carried["counts"]
        with autocast(self.settings, sums.device):
            p = rows_from(sums, counts, carried["p"])
            log_delta = _log_delta(p, self.present[k], self.hp)
        return {"p": p, "sums": torch.zeros_like(sums), "counts": torch.zeros_like(counts), "log_delta": log_delta}


class _CleanP:
    """``p_estimate: clean`` in a group: before each epoch but the first, node k's P from a clean pass of
    its model as it is then over its whole shard (`probability_matrix`, as `_Estimate` renews it), through
    a copy of the model holding the node's parameters (`train_vectorized`'s epoch_start), and log Delta
    from it; under the step's autocast, as `train` makes them inside its objective."""

    def __init__(
        self,
        model: nn.Module,
        datasets: Sequence[TensorDataset],
        present: Sequence[torch.Tensor],
        hp: Hyperparams,
        settings: TrainSettings,
    ) -> None:
        self.probe, self.datasets, self.settings = copy.deepcopy(model), datasets, settings
        self.present, self.hp = present, hp

    @torch.no_grad()
    def __call__(
        self, k: int, params: dict[str, torch.Tensor], carried: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        for name, parameter in self.probe.named_parameters():
            parameter.copy_(params[name])
        with autocast(self.settings, next(iter(params.values())).device):
            p = probability_matrix(self.probe, self.datasets[k])
            return {"p": p, "log_delta": _log_delta(p, self.present[k], self.hp)}


def _per_sample(
    logits: torch.Tensor, y: torch.Tensor, target: torch.Tensor, log_delta: torch.Tensor | None, hp: Hyperparams
) -> torch.Tensor:
    """Each sample's l1_weight L1 + lambda L2 (Eq. 9; a zero weight skips its term), before the batch's
    mean: one mean for both terms, where `local_loss` takes one each (the same value up to rounding); a
    weight of 1 multiplies nothing, and the second term is added with its weight (`add`'s alpha).
    `target`: y as a mask over the classes."""
    terms = []
    if hp.l2_weight != 0.0:
        adjusted = logits if log_delta is None else logits + take_rows(log_delta, y)
        terms.append((hp.l2_weight, nll(adjusted, y)))
    if hp.l1_weight != 0.0:
        terms.append((hp.l1_weight, flatten_loss(logits, y, detach_target=hp.detach_target, target=target)))
    (weight, first), *rest = terms  # Hyperparams refuses both weights 0
    return weighted_sum(first if weight == 1.0 else weight * first, *rest)


def _carried_p(batch: NodeBatch) -> _RunningP:
    """This node's P, log Delta and (running P) row sums at this step, as its carried state holds them:
    renewed between steps (`_RenewedRows`, `_CleanP`), read here."""
    carried = batch.carry
    return _RunningP(carried["p"], carried.get("sums"), carried.get("counts"), carried["log_delta"])


@dataclass(frozen=True, slots=True)
class _RunningP:
    """One node's P at one vectorised step (`_Estimate`'s running form, as a pure function)."""

    p: torch.Tensor
    sums: torch.Tensor | None
    """None with the clean P, which nothing accumulates into."""
    counts: torch.Tensor | None
    log_delta: torch.Tensor

    def fed(
        self, logits: torch.Tensor, target: torch.Tensor, mix: torch.Tensor | None, weight: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The carried state after the step: a mixed sample adds lam p to row y_a and (1 - lam) p to row
        y_b, as `accumulated` adds them. `target`: the labels as masks over the classes, (B, C), or with
        Mixup (`mix`: (lam, 1 - lam)) y_a's rows then y_b's, (2B, C)."""
        if self.sums is None or self.counts is None:  # the clean P: nothing accumulates
            return {"p": self.p, "log_delta": self.log_delta}
        dtype = self.sums.dtype
        probs = F.softmax(logits.detach().to(dtype), dim=1)
        # each sample's label as a row of weights over the classes, lam at y_a and 1 - lam at y_b (1 at y_a
        # without Mixup), times its weight: one product adds every sample's p to its rows
        rows = target.to(dtype)
        if mix is not None:
            by_label = rows.view(2, len(probs), -1)
            rows = torch.lerp(by_label[1], by_label[0], mix[0].to(dtype))
        rows = rows * weight.to(dtype).unsqueeze(1)
        sums, counts = self.sums + rows.T @ probs, self.counts + rows.sum(dim=0)
        return {"p": self.p, "sums": sums, "counts": counts, "log_delta": self.log_delta}


class _StepDraws:
    """FedACD's draws besides the batches (`fedcore.round_plan.StepDraws`), as `NodeHalf.train` makes
    them with Mixup: the numpy stream's seed before the first batch, then per batch lam ~ Beta(alpha,
    alpha) from it and, unless lam is 1, the batch's permutation from the node's generator."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def first(self, data: TensorDataset, settings: TrainSettings, generator: torch.Generator) -> object:
        return numpy_stream(generator)

    def step(self, state: object, s: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        assert isinstance(state, np.random.Generator)
        lam = mixup_lambda(self.alpha, state)
        perm = (
            torch.randperm(rows, generator=generator, device=generator.device)
            if lam != 1.0
            else torch.arange(rows, device=generator.device)
        )
        # (lam, 1 - lam) a row, each as `train` mixes with them (Python floats: float64)
        return {"mix": torch.tensor([[lam, 1.0 - lam]], dtype=torch.float64).repeat(rows, 1), "perm": perm}

    def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return drawn


class _Estimate:
    """P during one local training, and log Delta from it: a clean pass of the received model first,
    then per epoch either the mean of the previous epoch's detached outputs ("running") or a clean
    pass ("clean")."""

    def __init__(
        self, model: nn.Module, data: TensorDataset, present: torch.Tensor, hp: Hyperparams, settings: TrainSettings
    ) -> None:
        self.model, self.data, self.hp = model, data, hp
        self.per_epoch = _epoch_steps(data, settings)
        self.step = 0
        self.p = probability_matrix(model, data)
        self.present = present.to(self.p.device)
        self.sums = torch.zeros_like(self.p)
        self.counts = torch.zeros(len(self.p), dtype=self.p.dtype, device=self.p.device)
        self.log_delta = self._log_delta()

    def _log_delta(self) -> torch.Tensor:
        hp = self.hp
        return log_delta_matrix(
            self.p, self.present, delta_missing=hp.delta_missing, eps=hp.eps, clip=hp.log_delta_clip
        )

    def before_batch(self) -> torch.Tensor:
        """log Delta for this batch; at the start of every epoch but the first, P is renewed."""
        if self.step > 0 and self.step % self.per_epoch == 0:
            if self.hp.p_estimate == "running":
                self.p = rows_from(self.sums, self.counts, self.p)
                self.sums.zero_()
                self.counts.zero_()
            else:
                self.p = probability_matrix(self.model, self.data)
            self.log_delta = self._log_delta()
        self.step += 1
        return self.log_delta

    def after_batch(self, logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> None:
        """Running estimate: a mixed sample adds lam p to row y_a and (1 - lam) p to row y_b."""
        if self.hp.p_estimate != "running":
            return
        probs = F.softmax(logits.detach().to(self.sums.dtype), dim=1).to(self.sums.device)
        accumulate_rows(self.sums, self.counts, probs, y_a.to(self.sums.device), lam)
        if lam != 1.0:
            accumulate_rows(self.sums, self.counts, probs, y_b.to(self.sums.device), 1.0 - lam)


SPEC = base.AlgorithmSpec(name="fedacd", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
