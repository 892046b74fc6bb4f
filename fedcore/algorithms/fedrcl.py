"""FedRCL: relaxed contrastive learning for federated learning.

Seonguk Seo, Jinkyu Kim, Geeho Kim and Bohyung Han, "Relaxed Contrastive Learning for Federated Learning", CVPR 2024,
https://arxiv.org/abs/2401.04928; code https://github.com/skynbe/FedRCL (``clients/rcl_client.py``,
``utils/loss.py`` ``CLLoss``, ``configs/client/fedrcl.yaml``). Specification: fedrcl.md.

A client-side method; the server is FedAvg's. A node starts from the global model and minimises, per
mini-batch, with the L2-normalised features z^l of several depths l = 1..L and their cosine
similarities S^l = Z^l Z^lT (shared/specs/fedrcl.md 1.2-1.4):

    L = CE(logits, y) + w_scl (1/L) sum_l mean_i l_scl(i; S^l) + beta (1/L) sum_l mean_i l_pen(i; S^l)

The official code's terms (fedrcl.md 1.3; ``rcl_variant="official"``, ``penalty_topk=1``):

    l_scl(i) = (1/k_p) sum_{p in P_i} -log( e^{p/tau} / (e^{p/tau} + sum_{n in N_i} e^{n/tau}) )
        P_i = the k_p (topk_pos) smallest S_ij over same-class j, i itself included (S_ii = 1): the
              hardest positives; N_i = the k_n (topk_neg) largest S_ik over other-class k: the
              hardest negatives (fewer available: the missing ones are dropped)
    l_pen(i) = log(1 + sum_{k in K_i, S_ik >= lambda} e^{(S_ik - 1)/tau})
        K_i = the penalty_topk least similar same-class samples k != i; with penalty_topk = 1 the
              penalty fires only when even the least similar batch-mate is above lambda

The paper's Eq. 2/5 (``rcl_variant="paper"``, ``penalty_topk=0`` for all same-class samples):

    l_scl(i) = -(1/|Pos(i)|) sum_{j in Pos(i)} log( e^{S_ij/tau} / sum_{k != i} e^{S_ik/tau} )
    l_pen(i) = log(e^{1/tau} + sum_{k in Pos(i), S_ik >= lambda} e^{S_ik/tau}) - 1/tau    (Eq. 5)

Features (fedrcl.md 1.4, B3): the model's `forward_taps`, global-average-pooled and, for ResNets
and MobileNetV2, ``layer0`` (the stem before its ReLU) and ``layer1`` ... ``layer4`` (each
stage's last block before its final ReLU): the code's ``branch_level [0..4]``, pre-ReLU
(``feature_relu: False``), no projection head. ``taps`` picks others: ``auto`` (default) takes the
model's ``layerK`` taps, or every tap of a model that has none (the MLP's ``features``; a
small CNN's ``conv1``, ``conv2``, ``features``); ``all`` takes every tap; or a comma-separated list
(``layer4`` alone is the paper's "last layer only" ablation, Table 4). Missing taps are an
AlgorithmError.

Paper vs code, and choices (each an option defaulting to the spec's recommendation):
- SCL form (B1, ``rcl_variant``): "official" (default) hard-mines 1 positive and 2 negatives per
  anchor; "paper" is Eq. 2 over all positives and negatives, averaged over the positives
  (Khosla et al.'s normalisation, not Eq. 2's plain sum) so its scale matches. Both average over
  all anchors of the batch; an anchor without a positive contributes 0 ("paper").
- Penalty set (B2, ``penalty_topk``): 1 (default, the code) looks at the least similar same-class
  sample only; 0 takes every same-class sample above lambda (Eq. 5's P(i)). In the code the count
  is ``topk_pos`` (and the penalty is divided by it, a no-op at 1); here it is its own option.
  The penalty is counted once per anchor (not once per positive pair as Eq. 5 writes it), scaled
  by beta; its constant 1/tau is dropped (zero gradient), and where it does not fire it is
  exactly 0 (the code's e^{-2/tau} stand-in, about 4e-18 at tau = 0.05, is a constant too).
  The threshold test is S >= lambda as in the code (Eq. 5: >).
- ``topk_pos`` > 1 follows the code: the k hardest positives each against the same negatives,
  averaged over min(k, B) slots, a slot without a same-class sample counting 0.
- ``feature_relu`` (B3): False (default, the code) uses the pre-ReLU taps; True applies ReLU to
  the pooled taps, ReLU(GAP(h)), so similarities are non-negative as the paper's derivation
  assumes. It is not the code's GAP(ReLU(h)), which needs post-activation taps the models do not
  expose (``features`` is GAP(ReLU(layer4)) on a ResNet, already non-negative).
- Learning rate (1.5, B6): the per-round decay 0.998^t is the framework's ``train.lr_decay``; the
  code's extra decay within a round, x ``local_lr_decay`` per local epoch (LambdaLR), is done here
  by training epoch by epoch with lr x local_lr_decay^e. Each epoch re-creates the optimiser:
  exact for FedRCL's SGD without momentum; with momentum or Adam their state restarts every epoch.
  ``local_lr_decay = 1`` trains all epochs in one `local_sgd` call.
- Similarities and the contrastive losses are computed in float32 (B7). Mixed precision is not
  used; gradient clipping at 10 is ``train.max_grad_norm``.
- Aggregation (B9): ``weighted`` (default true) is FedAvg's size-weighted mean through
  ``self.average``; false is the code's plain mean (equal on FedRCL's equal-size splits).
- The code's frozen global model, proximal and feature-alignment terms have weight 0 (B12): not
  computed. Nothing but the model is exchanged; nodes keep no state between rounds.
- ``scl_weight = beta = 0`` and ``local_lr_decay = 1`` train exactly as FedAvg does (the terms are
  skipped, not multiplied by zero; the forward pass is the model's plain one).

Group form (`NodeHalf.group_term`, `fit_group`; `fedcore.vectorized`): the same loss as a pure
function of a node's padded batch, the taps from ``forward_taps`` run on the node's parameters. A
padding row is neither an anchor (weight 0) nor a positive, negative or penalty partner of any anchor
(masked as a sample of no class); what `train` gets from the batch size (min(k, B) slots, an anchor
without another sample) comes from the node's real count. The epochs train as `fit` trains them: one
vectorised call per epoch at lr x local_lr_decay^e, each node starting from its model of the epoch
before, the optimiser restarted. The similarities are float32 here as in `train`, so a group equals
one-by-one training to float32 rounding (about 1e-7), not to float64's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, fedavg, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.round_plan import BatchOutput
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.training import LossFn, TrainSettings, TrainStats, cross_entropy, local_sgd
from fedmq.fedcore.vectorized import GroupObjective, NodeBatch, functional_method, nll, train_vectorized, weighted_sum

RCL_VARIANTS = ("official", "paper")
TAP_CHOICES = ("auto", "all")
_TAP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_LAYER_TAP = re.compile(r"layer\d+")


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    temperature: float = 0.05
    """Contrastive temperature tau, positive (paper and code: 0.05)."""
    threshold: float = 0.7
    """Similarity threshold lambda of the divergence penalty, in [-1, 1] (paper and code: 0.7)."""
    beta: float = 1.0
    """Weight of the divergence penalty, non-negative (paper and code: 1; Table C: 2 for MobileNet-V2)."""
    scl_weight: float = 1.0
    """Weight of the supervised contrastive term, non-negative (code: 1, implicit in the paper)."""
    rcl_variant: str = "official"
    """SCL form: "official" (code: hard-mined, topk_pos / topk_neg) or "paper" (Eq. 2, all pairs; spec B1)."""
    topk_pos: int = 1
    """Hardest positives per anchor, at least 1, "official" only (code: 1; the anchor itself counts)."""
    topk_neg: int = 2
    """Hardest negatives per anchor, at least 1, "official" only (code: 2)."""
    penalty_topk: int = 1
    """Least similar same-class samples the penalty looks at, >= 0; 0 = all, Eq. 5's P(i) (code: 1; spec B2)."""
    taps: str = "auto"
    """Depths used: "auto" (layer0..layerN, else every tap; code: 5 ResNet-18 levels), "all" or "name,name"."""
    feature_relu: bool = False
    """ReLU on the pooled taps before normalising (code: false, pre-ReLU features; spec B3)."""
    local_lr_decay: float = 0.998
    """Per-local-epoch lr factor within a round, in (0, 1] (code's LambdaLR: 0.998; 1 = none; spec B6)."""
    weighted: bool = True
    """Size-weighted averaging (spec B9); false = the code's plain mean (equal on equal-size splits)."""

    def __post_init__(self) -> None:
        base.require_positive(self, "temperature")
        base.require_non_negative(self, "beta", "scl_weight")
        if not (math.isfinite(self.threshold) and -1.0 <= self.threshold <= 1.0):
            raise ValueError(f"threshold must be in [-1, 1], got {self.threshold!r}")
        if not (math.isfinite(self.local_lr_decay) and 0.0 < self.local_lr_decay <= 1.0):
            raise ValueError(f"local_lr_decay must be in (0, 1], got {self.local_lr_decay!r}")
        if self.rcl_variant not in RCL_VARIANTS:
            allowed = ", ".join(map(repr, RCL_VARIANTS))
            raise ValueError(f"rcl_variant must be one of {allowed}, got {self.rcl_variant!r}")
        for name in ("topk_pos", "topk_neg"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.penalty_topk < 0:
            raise ValueError(f"penalty_topk must be 0 (all) or more, got {self.penalty_topk!r}")
        tap_list(self.taps)  # raises ValueError on a malformed list


def tap_list(taps: str) -> tuple[str, ...]:
    """The tap names of a comma-separated ``taps`` value (empty for "auto" / "all"); ValueError if malformed."""
    if taps in TAP_CHOICES:
        return ()
    names = tuple(part.strip() for part in taps.split(","))
    if not all(_TAP_NAME.fullmatch(n) for n in names) or len(set(names)) != len(names):
        raise ValueError(f'taps must be "auto", "all" or a comma-separated list of distinct tap names, got {taps!r}')
    return names


def select_taps(taps: str, available: Sequence[str]) -> tuple[str, ...]:
    """The taps the loss uses, shallow to deep for "auto" / "all"; a requested tap the model lacks is a KeyError."""
    if taps == "all":
        return tuple(available)
    if taps == "auto":
        layers = tuple(n for n in available if _LAYER_TAP.fullmatch(n))
        return layers or tuple(available)
    names = tap_list(taps)
    missing = [n for n in names if n not in available]
    if missing:
        raise KeyError(f"the model has no taps {missing}; it has {list(available)}")
    return names


def similarity(z: torch.Tensor, *, relu: bool = False) -> torch.Tensor:
    """S = Z_hat Z_hat^T in float32: cosine similarities of the rows of `z` (B, d), after ReLU if `relu`."""
    z = z.float()
    if relu:
        z = F.relu(z)
    z = F.normalize(z, p=2, dim=1)
    return z @ z.T


def _masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(same class, i included; same class, i excluded), both (B, B) bool."""
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same, same & ~eye


def scl_official(
    sim: torch.Tensor, labels: torch.Tensor, temperature: float, *, topk_pos: int = 1, topk_neg: int = 2
) -> torch.Tensor:
    """Per-anchor hard-mined SCL of the code (fedrcl.md 1.3), shape (B,):
    l(i) = mean_{p in P_i} -log(e^{p/tau} / (e^{p/tau} + sum_{n in N_i} e^{n/tau})), P_i the topk_pos
    smallest same-class similarities (S_ii included), N_i the topk_neg largest other-class ones."""
    b = sim.shape[0]
    same, _ = _masks(labels)
    kp, kn = min(topk_pos, b), min(topk_neg, b)
    pos = sim.masked_fill(~same, math.inf).topk(kp, dim=1, largest=False).values  # (B, kp); inf = no such positive
    neg = sim.masked_fill(same, -math.inf).topk(kn, dim=1, largest=True).values  # (B, kn); -inf = dropped
    has_pos = torch.isfinite(pos)
    pos = torch.where(has_pos, pos, torch.zeros_like(pos))
    logits = torch.cat([pos.unsqueeze(2), neg.unsqueeze(1).expand(b, kp, kn)], dim=2) / temperature
    per_slot = torch.logsumexp(logits, dim=2) - logits[:, :, 0]  # -log softmax of the positive
    return torch.where(has_pos, per_slot, torch.zeros_like(per_slot)).sum(1) / kp


def scl_paper(sim: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-anchor SCL of Eq. 2, averaged over the positives, shape (B,):
    l(i) = -(1/|Pos(i)|) sum_{j in Pos(i)} log(e^{S_ij/tau} / sum_{k != i} e^{S_ik/tau}); 0 without positive."""
    b = sim.shape[0]
    if b < 2:
        return sim.new_zeros(b)
    _, positives = _masks(labels)
    eye = torch.eye(b, dtype=torch.bool, device=sim.device)
    logits = (sim / temperature).masked_fill(eye, -math.inf)
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    total = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(1)
    return -total / positives.sum(1).clamp(min=1)


def divergence_penalty(
    sim: torch.Tensor, labels: torch.Tensor, temperature: float, threshold: float, *, topk: int = 1
) -> torch.Tensor:
    """Per-anchor divergence penalty, shape (B,): l(i) = log(1 + sum_{k in K_i, S_ik >= lambda} e^{(S_ik - 1)/tau}),
    K_i the `topk` least similar same-class samples k != i (0: all of them), i.e. Eq. 5's
    log(e^{1/tau} + sum e^{S_ik/tau}) - 1/tau; 0 where no such sample reaches lambda."""
    b = sim.shape[0]
    _, others = _masks(labels)
    k = b if topk == 0 else min(topk, b)
    order = sim.masked_fill(~others, math.inf).sort(dim=1, stable=True).indices[:, :k]  # least similar first
    s = sim.gather(1, order)
    fires = others.gather(1, order) & (s >= threshold)
    terms = torch.where(fires, torch.exp((s - 1.0) / temperature), torch.zeros_like(s))
    return torch.log1p(terms.sum(1))


def rcl_loss(features: Sequence[torch.Tensor], labels: torch.Tensor, hp: Hyperparams) -> torch.Tensor:
    """w_scl mean_l mean_i l_scl(i; S^l) + beta mean_l mean_i l_pen(i; S^l) over the tapped depths
    (Algorithm 1; levels averaged, spec B4); a term with weight 0 is not computed."""
    scl_levels, pen_levels = [], []
    for z in features:
        sim = similarity(z, relu=hp.feature_relu)
        if hp.scl_weight != 0.0:
            if hp.rcl_variant == "official":
                scl = scl_official(sim, labels, hp.temperature, topk_pos=hp.topk_pos, topk_neg=hp.topk_neg)
            else:
                scl = scl_paper(sim, labels, hp.temperature)
            scl_levels.append(scl.mean())
        if hp.beta != 0.0:
            pen = divergence_penalty(sim, labels, hp.temperature, hp.threshold, topk=hp.penalty_topk)
            pen_levels.append(pen.mean())
    total = torch.zeros((), device=labels.device)
    if scl_levels:
        total = total + hp.scl_weight * torch.stack(scl_levels).mean()
    if pen_levels:
        total = total + hp.beta * torch.stack(pen_levels).mean()
    return total


def _scl_official_masked(
    sim: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, count: torch.Tensor, hp: Hyperparams
) -> torch.Tensor:
    """`scl_official` on a padded batch: the padding rows `~real` are no anchor's positive or negative,
    and the positives' slots are min(topk_pos, count) as in a batch of `count` samples."""
    b = sim.shape[0]
    same = labels[:, None] == labels[None, :]
    kp, kn = min(hp.topk_pos, b), min(hp.topk_neg, b)
    pos = sim.masked_fill(~(same & real[None, :]), math.inf).topk(kp, dim=1, largest=False).values
    neg = sim.masked_fill(same | ~real[None, :], -math.inf).topk(kn, dim=1, largest=True).values
    has_pos = torch.isfinite(pos)
    pos = torch.where(has_pos, pos, torch.zeros_like(pos))
    logits = torch.cat([pos.unsqueeze(2), neg.unsqueeze(1).expand(b, kp, kn)], dim=2) / hp.temperature
    per_slot = torch.logsumexp(logits, dim=2) - logits[:, :, 0]
    return torch.where(has_pos, per_slot, torch.zeros_like(per_slot)).sum(1) / count.clamp(max=hp.topk_pos)


def _scl_paper_masked(sim: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, temperature: float) -> torch.Tensor:
    """`scl_paper` on a padded batch; an anchor with no other real sample (a batch of one) gets 0, its
    row kept finite (unmasked) so that its zero has a zero gradient, not a NaN one."""
    b = sim.shape[0]
    pair = ~torch.eye(b, dtype=torch.bool, device=sim.device) & real[None, :]
    positives = (labels[:, None] == labels[None, :]) & pair
    usable = pair | ~pair.any(dim=1, keepdim=True)
    logits = (sim / temperature).masked_fill(~usable, -math.inf)
    log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
    total = torch.where(positives, log_prob, torch.zeros_like(log_prob)).sum(1)
    return -total / positives.sum(1).clamp(min=1)


def _penalty_masked(sim: torch.Tensor, labels: torch.Tensor, real: torch.Tensor, hp: Hyperparams) -> torch.Tensor:
    """`divergence_penalty` on a padded batch: padding rows are no anchor's same-class partner."""
    b = sim.shape[0]
    eye = torch.eye(b, dtype=torch.bool, device=sim.device)
    others = (labels[:, None] == labels[None, :]) & ~eye & real[None, :]
    k = b if hp.penalty_topk == 0 else min(hp.penalty_topk, b)
    order = sim.masked_fill(~others, math.inf).sort(dim=1, stable=True).indices[:, :k]
    s = sim.gather(1, order)
    fires = others.gather(1, order) & (s >= hp.threshold)
    terms = torch.where(fires, torch.exp((s - 1.0) / hp.temperature), torch.zeros_like(s))
    return torch.log1p(terms.sum(1))


def group_rcl_loss(features: Sequence[torch.Tensor], batch: NodeBatch, hp: Hyperparams) -> torch.Tensor:
    """`rcl_loss` of a node's padded batch (`NodeBatch`), each level's mean over its real anchors in
    float32 as `rcl_loss` takes it. A node with no batch left (every weight 0, under a captured step)
    counts all its rows as real, so that its (unused) loss and gradient stay finite."""
    real = (batch.weight > 0) | (batch.weight == 0).all()
    weight, count = batch.weight.float(), batch.count.float()
    scl_levels, pen_levels = [], []
    for z in features:
        sim = similarity(z, relu=hp.feature_relu)
        if hp.scl_weight != 0.0:
            if hp.rcl_variant == "official":
                scl = _scl_official_masked(sim, batch.y, real, count, hp)
            else:
                scl = _scl_paper_masked(sim, batch.y, real, hp.temperature)
            scl_levels.append((scl * weight).sum() / count)
        if hp.beta != 0.0:
            pen_levels.append((_penalty_masked(sim, batch.y, real, hp) * weight).sum() / count)
    weighted = [(hp.scl_weight, torch.stack(scl_levels).mean())] if scl_levels else []
    weighted += [(hp.beta, torch.stack(pen_levels).mean())] if pen_levels else []
    return weighted_sum(torch.zeros((), device=batch.y.device), *weighted)


class CoordinatorHalf(fedavg.CoordinatorHalf):
    """FedAvg's server: the (size-weighted, or plain with ``weighted: false``) average of the updates."""


class NodeHalf(shared.LossTermNode[Hyperparams]):
    def objective(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> LossFn | None:
        hp = self.hp
        if hp.scl_weight == 0.0 and hp.beta == 0.0:
            return None
        names = self._taps(model, task.round)

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits, taps = m.forward_taps(x)  # type: ignore[operator]
            # L = CE + w_scl mean_l L_SCL^l + beta mean_l L_pen^l   (Eq. 5, Algorithm 1)
            return F.cross_entropy(logits, y) + rcl_loss([taps[n] for n in names], y, hp)

        return objective

    def fit(
        self,
        model: nn.Module,
        data: TensorDataset,
        settings: TrainSettings,
        generator: torch.Generator,
        objective: LossFn | None,
    ) -> TrainStats:
        """`local_sgd`, epoch e at lr x local_lr_decay^e (the code's LambdaLR stepped per local epoch)."""
        loss_fn = cross_entropy if objective is None else objective
        decay = self.hp.local_lr_decay
        if decay == 1.0 or settings.local_epochs == 1:
            return local_sgd(model, data, settings, generator, loss_fn=loss_fn)
        total, steps, seen = 0.0, 0, 0
        for epoch in range(settings.local_epochs):
            epoch_settings = replace(settings, local_epochs=1, lr=settings.lr * decay**epoch)
            stats = local_sgd(model, data, epoch_settings, generator, loss_fn=loss_fn)
            total += stats.loss * stats.samples_seen
            steps += stats.steps
            seen += stats.samples_seen
        return TrainStats(loss=total / max(seen, 1), steps=steps, samples_seen=seen)

    def group_term(self, task: base.TaskInput, model: nn.Module, data: TensorDataset) -> shared.GroupTerm | None:
        hp = self.hp
        if hp.scl_weight == 0.0 and hp.beta == 0.0:
            return None
        names = self._taps(model, task.round)
        forward_taps = functional_method(model, "forward_taps")

        def objective(batch: NodeBatch) -> torch.Tensor:
            out = forward_taps(batch.params, batch.x)
            assert isinstance(out, tuple)
            logits, taps = out
            return batch.mean(nll(logits, batch.y)) + group_rcl_loss([taps[n] for n in names], batch, hp)

        # kept from round to round under its hyperparameters: its taps follow from them and the model, which
        # a kept round's signature holds
        return shared.GroupTerm(objective, key=self.hp)

    def fit_group(
        self,
        model: nn.Module,
        datasets: Sequence[TensorDataset],
        settings: TrainSettings,
        generators: Sequence[torch.Generator],
        objective: GroupObjective,
        inputs: dict[str, torch.Tensor],
        *,
        keep_as: Hashable | None = None,
        outputs: Mapping[str, BatchOutput] | None = None,
    ) -> list[tuple[StateDict, TrainStats]]:
        """`fit` for a group: epoch e at lr x local_lr_decay^e, one vectorised call per epoch, each node
        going on from its own model of the epoch before. Every epoch and round trains in one kept round
        under `keep_as` (the lr is read from the device: on a GPU one capture serves them all)."""
        decay = self.hp.local_lr_decay
        if decay == 1.0 or settings.local_epochs == 1:
            return super().fit_group(
                model, datasets, settings, generators, objective, inputs, keep_as=keep_as, outputs=outputs
            )  # fmt: skip
        states: list[StateDict] | None = None
        totals = [(0.0, 0, 0)] * len(datasets)
        for epoch in range(settings.local_epochs):
            epoch_settings = replace(settings, local_epochs=1, lr=settings.lr * decay**epoch)
            results = train_vectorized(
                model, datasets, epoch_settings, generators, objective=objective, inputs=inputs, starts=states,
                keep_as=keep_as, outputs=outputs,
            )  # fmt: skip
            states = [state for state, _ in results]
            totals = [
                (total + stats.loss * stats.samples_seen, steps + stats.steps, seen + stats.samples_seen)
                for (total, steps, seen), (_, stats) in zip(totals, results, strict=True)
            ]
        assert states is not None
        return [
            (state, TrainStats(loss=total / max(seen, 1), steps=steps, samples_seen=seen))
            for state, (total, steps, seen) in zip(states, totals, strict=True)
        ]

    def _taps(self, model: nn.Module, round: int) -> tuple[str, ...]:
        available = getattr(model, "tap_names", None)
        if available is None or not callable(getattr(model, "forward_taps", None)):
            raise AlgorithmError(
                f"FedRCL needs a model with forward_taps(x) and tap_names, not {type(model).__name__}",
                node_id=self.node_id,
                round=round,
            )
        try:
            return select_taps(self.hp.taps, available)
        except KeyError as exc:
            raise AlgorithmError(f"FedRCL taps: {exc.args[0]}", node_id=self.node_id, round=round) from exc


SPEC = base.AlgorithmSpec(name="fedrcl", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
