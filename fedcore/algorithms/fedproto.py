"""FedProto: federated prototype learning.

Tan, Long, Liu, Zhou, Lu, Jiang and Zhang, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI 2022, https://arxiv.org/abs/2105.00243; code
https://github.com/yuetan031/FedProto (``lib/update.py`` ``update_weights_het``, ``lib/utils.py``
``proto_aggregation``, ``exps/federated_main.py``).

Only class prototypes travel in FedProto. Each client keeps its own model across rounds; it trains
on, per mini-batch,

    L = CE(F(x), y) + lambda MSE(f(x), C_bar^(y))                   (local objective, as the code computes it)

with f(x) the representation (here ``model.extract(x).flatten(1)``, the input of the classifier),
C_bar^(y) the global prototype of the sample's class, and MSE the mean over the batch and the d
features (a sample whose class has no global prototype yet contributes 0; in the first round no
prototype exists and L is plain CE). It then uploads its local prototypes C_i^(j), the mean
representation of each class j it holds, with the class counts n_ij; the coordinator sets, for every
class some update holds,

    C_bar^(j) = sum_i n_ij C_i^(j) / sum_i n_ij                     (global prototype, count-weighted)

and keeps the previous prototype of the other classes. Inference is by the nearest global
prototype: argmin_j ||f(x) - C_bar^(j)||.

The paper is not in the repository: the formulas are restated from the authors' code and the
paper's method section, without equation numbers (not checked against the text).

How it fits this framework (deviations, documented):
- FedProto has no global model, but a round ends with the coordinator's model evaluated on the test
  set. So nodes also upload their models, and the coordinator averages them (`self.average`, sample
  weights) into an **evaluation-only** model. With ``local_models: true`` (default, the paper) that
  average is never trained from: each node restores its own model, kept by the node half on the CPU
  between rounds (it lives as long as the node daemon; 100 simulated nodes keep 100 models). A node's
  first local model is the model broadcast when it first trains: the common initial model in round
  0 (as in the paper, where all clients start from one initialisation), the average of the others'
  later. The model upload costs what FedAvg's does; FedProto's own traffic is the prototypes.
- ``local_models: false`` makes the average the global model nodes start from: FedAvg with FedProto's
  prototype regulariser (not the paper's method; ``proto_weight = 0`` then gives FedAvg exactly).
- Evaluation: the first model reported is the average's own classifier head; with
  ``evaluate_prototypes: true`` FedProto's nearest-prototype rule on the average's representations is
  reported first (as ``accuracy``; the head's becomes ``accuracy_global``). Neither is the paper's
  metric, which is each client's model on its own test split (personalised accuracy): the paper's
  numbers cannot be reproduced with one global test set, and no table of the specs uses FedProto.

Paper vs code, and choices:
- Aggregation weights (`weighting`): "counts" (default) is the paper's global-prototype formula
  read as a count-weighted mean (its printed normalisation, 1 / |N_j| times n_ij / N_j, does not
  sum to 1); "uniform" is the code's plain mean over the clients holding the class.
- Local prototypes (`prototype_pass`): "train" (default, the code) averages the representations the
  model produced on the training batches of the last local epoch, while it was changing (with
  augmentation); "eval" is the paper's local-prototype definition read literally: one pass of the
  trained model, in eval mode, without augmentation, over the node's data.
- The regulariser is per sample (the code's MSE between f(x) and C_bar^(y)); the paper's objective
  writes it between the local and the global prototypes.
- The uploaded class counts are the node's label histogram (of the last epoch for "train"): the
  method needs them for the global prototypes, so they leave the node.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.tensors import StateDict, TensorSpec, cpu_copy, schema_of
from fedmq.fedcore.training import TrainSettings, local_sgd
from fedmq.fedcore.vectorized import (
    NodeBatch,
    functional_method,
    nll,
    steps_per_epoch,
    train_vectorized,
    unsupported,
    weighted_sum,
)

logger = logging.getLogger(__name__)

WEIGHTINGS = ("counts", "uniform")
PASSES = ("train", "eval")
EVAL_BATCH = 512
"""Batch size of the "eval" prototype pass."""
ABSENT_MARGIN = 1e4
"""How far below a row's lowest logit the nearest-prototype classifier puts classes without a prototype."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    proto_weight: float = 1.0
    """lambda, weight of the prototype regulariser, non-negative (the code's --ld: 1; FedNH's code uses 0.1)."""
    weighting: str = "counts"
    """How the coordinator averages a class's local prototypes: "counts" (the paper) or "uniform" (the code)."""
    prototype_pass: str = "train"
    """Where local prototypes come from: "train" (the last local epoch's batches, the code) or "eval" (the paper)."""
    local_models: bool = True
    """Nodes keep their own models across rounds (the paper); false: they start from the coordinator's average."""
    evaluate_prototypes: bool = False
    """Report nearest-prototype accuracy of the averaged model first (FedProto's inference rule)."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "proto_weight")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(map(repr, WEIGHTINGS))}, got {self.weighting!r}")
        if self.prototype_pass not in PASSES:
            raise ValueError(
                f"prototype_pass must be one of {', '.join(map(repr, PASSES))}, got {self.prototype_pass!r}"
            )


# -- losses and aggregation ------------------------------------------------------------------------


def prototype_loss(
    features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor, present: torch.Tensor
) -> torch.Tensor:
    """MSE(f(x), C_bar^(y)) over the batch and the features; a sample whose class has no prototype
    is its own target (0), as in the code."""
    target = torch.where(present[labels][:, None], prototypes[labels], features.detach())
    return F.mse_loss(features, target)


def aggregate_prototypes(
    means: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], weighting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C_bar, held): per class, the count-weighted (paper) or plain (code) mean of the local
    prototypes of the clients holding it, and which classes some client holds (the others are 0)."""
    acc = torch.zeros(means[0].shape, dtype=torch.float64)
    total = torch.zeros(means[0].shape[0], dtype=torch.float64)
    for mean, count in zip(means, counts, strict=True):
        n = count.to("cpu", torch.float64)
        w = n if weighting == "counts" else (n > 0).to(torch.float64)
        acc += w[:, None] * mean.to("cpu", torch.float64)
        total += w
    held = total > 0
    return (acc / total.clamp(min=1.0)[:, None]).float(), held


class NearestPrototype(nn.Module):
    """FedProto's inference on a model's representations: logits -||f(x) - C_bar^(j)||^2, classes
    without a prototype `ABSENT_MARGIN` below a row's lowest logit (never predicted, finite loss)."""

    prototypes: torch.Tensor  # buffers
    present: torch.Tensor

    def __init__(self, body: nn.Module, prototypes: torch.Tensor, present: torch.Tensor) -> None:
        super().__init__()
        self.body = body
        self.register_buffer("prototypes", prototypes.detach().clone())
        self.register_buffer("present", present.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.body.extract(x).flatten(1)  # type: ignore[operator]
        logits = -torch.cdist(features, self.prototypes.to(features.dtype)).pow(2)
        if not bool(self.present.any()):
            return torch.zeros_like(logits)
        floor = logits[:, self.present].min(dim=1, keepdim=True).values - ABSENT_MARGIN
        return torch.where(self.present[None, :], logits, floor)


# -- the two halves --------------------------------------------------------------------------------


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    sync_only = (
        "FedProto nodes train their own kept models, not the model they are sent, so an update is no "
        "step from a version, and each round's prototypes replace the global ones by that cohort's mean"
    )

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.classes, self.dim = shared.model_shape(model, "FedProto")
        self.prototypes = torch.zeros(self.classes, self.dim)
        """C_bar, (C, d) on the CPU; rows of classes without a prototype are 0."""
        self.present = torch.zeros(self.classes, dtype=torch.bool)
        """Which classes have a global prototype (none before the first aggregation)."""

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(
            tensors={
                "model": self.model.state_dict(),
                "prototypes": {"weight": self.prototypes, "present": self.present},
            }
        )

    def update_schema(self) -> dict[str, dict[str, TensorSpec]]:
        return {
            "model": schema_of(self.model.state_dict()),
            "class_means": shared.class_means_schema(self.classes, self.dim),
        }

    def evaluation_models(self) -> Mapping[str, nn.Module]:
        if not self.hp.evaluate_prototypes:
            return {"global": self.model}
        return {"prototype": NearestPrototype(self.model, self.prototypes, self.present), "global": self.model}

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        valid = shared.valid_updates(ctx, updates, self._invalid, logger)
        if not valid:
            raise AlgorithmError("no update of this round carries valid FedProto prototypes", round=ctx.round)
        weights = [float(u.num_samples) for u in valid]
        # the models' average: for evaluation only (local_models) or the next global model
        self.model.load_state_dict(shared.sync_average(self, ctx, valid, weights))
        # C_bar^(j) for the classes held this round; the others keep theirs
        stats = [u.payload.tensors["class_means"] for u in valid]
        new, held = aggregate_prototypes([s["means"] for s in stats], [s["counts"] for s in stats], self.hp.weighting)
        self.prototypes = torch.where(held[:, None], new, self.prototypes)
        self.present = self.present | held
        return {
            "train_loss": shared.mean_reported_loss(valid, weights),
            "fedproto_invalid": float(len(updates) - len(valid)),
            "fedproto_classes": float(self.present.sum()),
        }

    def _invalid(self, update: base.NodeUpdate) -> str | None:
        """Why the update's local prototypes cannot be used, or None: they came over the wire."""
        return shared.class_means_problem(update, self.classes, self.dim)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"prototypes": self.prototypes, "present": self.present}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != {"prototypes", "present"}:
            raise ValueError(f"FedProto state must hold prototypes and present, got {sorted(state)[:5]}")
        prototypes, present = state["prototypes"], state["present"]
        if tuple(prototypes.shape) != (self.classes, self.dim) or tuple(present.shape) != (self.classes,):
            raise ValueError(
                f"FedProto state has prototypes {tuple(prototypes.shape)} and present {tuple(present.shape)}, "
                f"expected {(self.classes, self.dim)} and ({self.classes},)"
            )
        if present.dtype != torch.bool or not bool(torch.isfinite(prototypes).all()):
            raise ValueError("FedProto state needs finite prototypes and a boolean present mask")
        self.prototypes = prototypes.detach().to("cpu", torch.float32).clone()
        self.present = present.detach().to("cpu").clone()


class NodeHalf(base.NodeHalf[Hyperparams]):
    def __init__(self, hp: Hyperparams, *, node_id: str) -> None:
        super().__init__(hp, node_id=node_id)
        self.local: StateDict | None = None
        """This node's own model between rounds, on the CPU (``local_models``; None before its first round)."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        if self.hp.local_models and self.local is not None:
            model.load_state_dict(self.local)  # FedProto: the node goes on from its own model
        classes, dim = shared.node_model_shape(model, "FedProto", node_id=self.node_id, round=task.round)
        device = next(model.parameters()).device
        prototypes, present = self._global_prototypes(task, classes, dim, device)
        lam = self.hp.proto_weight
        regularise = lam > 0.0 and bool(present.any())
        record = self.hp.prototype_pass == "train"
        sums = torch.zeros(classes, dim, device=device)
        counts = torch.zeros(classes, dtype=torch.int64, device=device)
        per_epoch = steps_per_epoch(len(data), task.settings.batch_size, task.settings.drop_last)
        first_recorded = (task.settings.local_epochs - 1) * per_epoch
        step = 0

        def objective(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            nonlocal step
            h = m.extract(x)  # type: ignore[operator]
            features = h.flatten(1)
            loss = F.cross_entropy(m.classify(h), y)  # type: ignore[operator]  # = CE(m(x), y), bit for bit
            if regularise:
                # CE(F(x), y) + lambda MSE(f(x), C_bar^(y))
                loss = loss + lam * prototype_loss(features, y, prototypes, present)
            if record and step >= first_recorded:  # the last local epoch's representations (the code's C_i)
                shared.add_rows(sums, y, features.detach().float())
                counts.add_(torch.bincount(y, minlength=classes))
            step += 1
            return loss

        stats = local_sgd(model, data, task.settings, generator, loss_fn=objective)
        if not record:
            sums, counts = _eval_pass(model, data, classes, dim, device)
        means = sums / counts.clamp(min=1)[:, None].to(sums.dtype)  # C_i^(j); zero rows for absent classes
        if self.hp.local_models:
            self.local = cpu_copy(model.state_dict())
        return base.Payload(
            tensors={"model": model.state_dict(), "class_means": {"means": means, "counts": counts}},
            meta={"loss": stats.loss, "steps": stats.steps},
        )

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: each from its own model (``local_models``), CE plus the
        prototype term on its padded batch, and its local prototypes from the representations of its
        last epoch, summed on the device as it trains (``prototype_pass: train``), or from a pass of its
        trained model (``eval``)."""
        first = shared.start_group(self, members, model)
        classes, dim = shared.node_model_shape(model, "FedProto", node_id=self.node_id, round=first.task.round)
        device = next(model.parameters()).device
        prototypes, present = self._global_prototypes(first.task, classes, dim, device)
        lam, record = self.hp.proto_weight, self.hp.prototype_pass == "train"
        regularise = lam > 0.0 and bool(present.any())
        halves = [cast(NodeHalf, m.half) for m in members]
        starts = [h.local if self.hp.local_models and h.local is not None else model.state_dict() for h in halves]
        extract, classify = functional_method(model, "extract"), functional_method(model, "classify")

        # the global prototypes as each member's inputs (the same rows), so that a later round's group
        # may train in this one's kept round, which copies its inputs in (`keep_as`)
        k = len(members)
        inputs = {"prototypes": prototypes.expand(k, classes, dim), "present": present.expand(k, classes)}

        def objective(batch: NodeBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            h = extract(batch.params, batch.x)
            assert isinstance(h, torch.Tensor)
            logits = classify(batch.params, h)
            assert isinstance(logits, torch.Tensor)
            features = h.flatten(1)
            per_sample = nll(logits, batch.y)
            if regularise:  # lambda MSE(f(x), C_bar^(y)), a mean over the real rows and the features
                known, centres = batch.inputs["present"], batch.inputs["prototypes"]
                target = torch.where(known[batch.y][:, None], centres[batch.y], features.detach())
                per_sample = weighted_sum(per_sample, (lam, (features - target).pow(2).mean(dim=1)))
            loss = batch.mean(per_sample)
            if not record:
                return loss, {}
            kept = batch.weight * batch.step["record"]  # the real rows of the last epoch's steps
            onehot = F.one_hot(batch.y, classes).to(torch.float32) * kept[:, None].to(torch.float32)
            sums = onehot.t() @ features.detach().float()
            return loss, {"sums": sums, "counts": onehot.sum(dim=0)}

        results = train_vectorized(
            model, [m.data for m in members], first.task.settings, [m.generator for m in members],
            objective=objective, draws=_LastEpoch() if record else None, starts=starts, inputs=inputs,
            keep_as=("fedproto", self.hp, regularise, classes, dim),
        )  # fmt: skip
        payloads = []
        for half, member, (state, stats) in zip(halves, members, results, strict=True):
            if record:
                sums = stats.sums["sums"].to(device, torch.float32)
                counts = stats.sums["counts"].round().to(device, torch.int64)
            else:
                model.load_state_dict(state)
                sums, counts = _eval_pass(model, member.data, classes, dim, device)
            means = sums / counts.clamp(min=1)[:, None].to(sums.dtype)
            if self.hp.local_models:
                half.local = cpu_copy(state)
            payloads.append(
                base.Payload(
                    tensors={"model": state, "class_means": {"means": means, "counts": counts}},
                    meta={"loss": stats.loss, "steps": stats.steps},
                )
            )
        return payloads

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)

    def _global_prototypes(
        self, task: base.TaskInput, classes: int, dim: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        group = task.payload.tensors.get("prototypes", {})
        weight, present = group.get("weight"), group.get("present")
        if (
            weight is None
            or present is None
            or tuple(weight.shape) != (classes, dim)
            or tuple(present.shape) != (classes,)
            or present.dtype != torch.bool
        ):
            raise AlgorithmError(
                f"task carries no usable global prototypes ({classes} x {dim}, with a mask)",
                node_id=self.node_id,
                round=task.round,
            )
        return weight.to(device, torch.float32), present.to(device)


class _LastEpoch:
    """Which of a node's steps are in its last local epoch, as `NodeHalf.train` records them
    (`fedcore.round_plan.StepDraws`: a constant per step, nothing drawn from the generator)."""

    def first(self, data: TensorDataset, settings: TrainSettings, generator: torch.Generator) -> object:
        return (settings.local_epochs - 1) * steps_per_epoch(len(data), settings.batch_size, settings.drop_last)

    def step(self, state: object, s: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        assert isinstance(state, int)
        return {"record": torch.full((rows,), 1.0 if s >= state else 0.0, dtype=torch.float64)}

    def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return drawn


def _eval_pass(
    model: nn.Module, data: TensorDataset, classes: int, dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums of the trained model's representations and the class counts, in eval mode,
    without gradients or augmentation (the paper's C_i^(j) once divided)."""
    model.eval()
    sums = torch.zeros(classes, dim, device=device)
    counts = torch.zeros(classes, dtype=torch.int64, device=device)
    with torch.no_grad():
        for start in range(0, len(data), EVAL_BATCH):
            x, y = data.eval_batch(start, start + EVAL_BATCH)
            x, y = x.to(device), y.to(device)
            shared.add_rows(sums, y, model.extract(x).flatten(1).float())  # type: ignore[operator]
            counts += torch.bincount(y, minlength=classes)
    return sums, counts


SPEC = base.AlgorithmSpec(name="fedproto", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
