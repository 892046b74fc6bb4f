"""FedNH: federated learning with fixed, smoothly updated class prototypes.

Dai, Chen, Li, Heinecke, Sun and Xu, "Tackling Data Heterogeneity in Federated Learning with Class
Prototypes", AAAI 2023, https://arxiv.org/abs/2212.02758; code https://github.com/Yutong-Dai/FedNH
(``src/flbase/strategies/FedNH.py``, ``FedUH.py``, ``models/CNN.py``, ``main.py``).

The classifier is a matrix W of C class prototypes, one unit vector per class in the feature space,
and the logits are scaled cosine similarities

    logit_c(x) = s <phi(x) / ||phi(x)||, w_c / ||w_c||>

with phi the model's feature extractor (``model.extract(x).flatten(1)``, the input of its head) and
s a scale. The coordinator initialises W uniformly spread on the unit sphere; nodes keep W fixed
while they train phi (and s) with cross-entropy, then upload, for every class c they hold, the
unit-normalised mean of their normalised features mu_kc and its count n_kc. The coordinator
averages the bodies (and s) as FedAvg does, and moves each prototype smoothly towards the clients'
count-weighted mean direction:

    mu_c = normalize( sum_k n_kc mu_kc / sum_k n_kc )
    w_c <- normalize( rho w_c + (1 - rho) mu_c )                         (smoothed aggregation)

for every class some update of the round holds; the others keep their prototype. (Restated from
the authors' code and the paper's method section; the paper is not in the repository, so no
equation numbers are given.)

Where the prototypes live: a separate tensor group (``prototypes`` in the broadcast, state of the
coordinator), not the model's head. That works with any FedModel, whatever its head (MOON's CNN has
a projection head, not a single Linear of shape (C, d)); the model's own head parameters are left
unused (they get no gradient and keep their initial values) and still travel with the model. The
coordinator evaluates its model through the prototype classifier (`evaluation_models`).

What travels besides the model: W and s to the nodes; from each node its per-class feature means
and **per-class sample counts** (group ``class_means``: the method needs them, so a node's label
histogram leaves it) and, when s is learnt, its s (group ``scale``).

Paper vs code, and choices:
- Initialisation (`init`): the paper asks for prototypes uniformly spread on the sphere. "orthogonal"
  (default, the code's ``FedNH_head_init``) gives orthonormal rows when C <= d (the QR factor of a
  Gaussian matrix); when C > d no orthonormal set exists, and the code's ``orthogonal_`` then gives
  rows that are neither unit nor spread, so here it falls back to "spread": unit rows that repel
  each other as charges on the sphere (Thomson's problem; for 6 classes in 2 dimensions a hexagon,
  for 12 in 3 an icosahedron). The Gaussian draw comes from a generator seeded by
  `prototype_seed`, never from torch's global RNG.
- Scale s: the code learns it (``FedNH_fix_scaling: False``) as a model parameter that is averaged
  with the body, starting from 1 for its CIFAR CNN and 20 for its ResNet-18; `learn_scale` false
  keeps it fixed at `scale` (the code's fixed variant uses 30).
- Aggregation weights (`weighted`): the code averages the bodies with equal weights (``server_lr /
  num_participants``); the default here weights by sample counts as the framework's FedAvg does;
  false reproduces the code. The prototype update is count-weighted in both (the code's
  ``scaled_prototype / cumsum_per_class``).
- The node computes its class means after training, in eval mode, on its clean data (no
  augmentation); the code runs the same pass over its training loader, augmentation included.
- The code's optional "adversarial" prototype aggregation (``FedNH_*_adv_prototype_agg``, off by
  default) is not implemented.
- ``smoothing = 1`` keeps the initial prototypes for ever (FedUH, the code's ancestor). No setting
  reduces FedNH to FedAvg: the classifier itself differs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedmq.fedcore.algorithms import base, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import TensorSpec, schema_of
from fedmq.fedcore.training import local_sgd
from fedmq.fedcore.vectorized import train_vectorized, unsupported

logger = logging.getLogger(__name__)

INITS = ("orthogonal", "spread")
SCALE_KEY = "fednh.scale"
"""Where s rides along with the model through `CoordinatorHalf.average` (then taken out again)."""
EVAL_BATCH = 512
"""Batch size of the node's pass that computes its class means."""
SPREAD_STEPS = 500
"""Repulsion steps of the "spread" initialisation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    smoothing: float = 0.9
    """rho, in [0, 1]: weight of the old prototype in the server's update (paper and code: 0.9)."""
    scale: float = 1.0
    """Initial (or, with learn_scale false, fixed) logit scale s, positive (code: 1 for its CNN, 20 for ResNet-18)."""
    learn_scale: bool = True
    """Train s with the body and average it like a parameter (the code's default); false keeps it fixed."""
    init: str = "orthogonal"
    """Prototype initialisation: "orthogonal" (the code; "spread" when classes > feature_dim) or "spread"."""
    prototype_seed: int = 0
    """Seed of the generator that draws the initial prototypes (a non-negative integer; the run seed does not enter)."""
    weighted: bool = True
    """Average the bodies weighted by sample counts (the framework's FedAvg); false: plain mean (FedNH's code)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.smoothing) and 0.0 <= self.smoothing <= 1.0):
            raise ValueError(f"smoothing must be in [0, 1], got {self.smoothing!r}")
        base.require_positive(self, "scale")
        if self.prototype_seed < 0:
            raise ValueError(f"prototype_seed must be a non-negative integer, got {self.prototype_seed!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {', '.join(map(repr, INITS))}, got {self.init!r}")


# -- prototypes ------------------------------------------------------------------------------------


def orthogonal_prototypes(classes: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """C orthonormal rows in R^d (C <= d): the transposed Q factor of a Gaussian d x C matrix."""
    if classes > dim:
        raise ValueError(f"{classes} orthonormal prototypes do not fit in {dim} dimensions")
    gaussian = torch.randn(dim, classes, generator=generator, dtype=torch.float64)
    q, _ = torch.linalg.qr(gaussian)
    return q.t().contiguous().float()


def spread_prototypes(classes: int, dim: int, generator: torch.Generator, steps: int = SPREAD_STEPS) -> torch.Tensor:
    """C unit rows in R^d spread over the sphere: Gaussian rows, normalised, then moved apart by
    their mutual repulsion (Thomson's problem: tangential part of sum_j (w_i - w_j) / |w_i - w_j|^3,
    the largest move a decaying fraction of a radian, rows renormalised after every step)."""
    w = F.normalize(torch.randn(classes, dim, generator=generator, dtype=torch.float64), dim=1)
    if dim == 1:  # no room to move on the 0-sphere: alternate the two points
        return torch.tensor([[1.0 if c % 2 == 0 else -1.0] for c in range(classes)])
    if classes == 1:
        return w.float()
    self_pairs = torch.eye(classes, dtype=torch.bool)
    for step in range(steps):
        dist = torch.cdist(w, w).masked_fill(self_pairs, math.inf).clamp(min=1e-9)
        k = dist.pow(-3)
        force = w * k.sum(dim=1, keepdim=True) - k @ w  # sum_j (w_i - w_j) / |w_i - w_j|^3
        force = force - (force * w).sum(dim=1, keepdim=True) * w  # its part tangent to the sphere
        size = 0.2 * (1.0 - step / steps) + 1e-3
        w = F.normalize(w + size * force / force.norm(dim=1).max().clamp(min=1e-12), dim=1)
    return w.float()


def initial_prototypes(classes: int, dim: int, init: str, generator: torch.Generator) -> torch.Tensor:
    """The (C, d) unit prototypes the coordinator starts from (see `Hyperparams.init`)."""
    if init == "orthogonal" and classes <= dim:
        return orthogonal_prototypes(classes, dim, generator)
    return spread_prototypes(classes, dim, generator)


def fednh_logits(features: torch.Tensor, prototypes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """s <phi / ||phi||, w_c / ||w_c||> for every class c: (B, d) features, (C, d) prototypes -> (B, C)."""
    return scale * (F.normalize(features, dim=1) @ F.normalize(prototypes, dim=1).t())


def update_prototypes(
    prototypes: torch.Tensor, means: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], smoothing: float
) -> torch.Tensor:
    """The smoothed server update: w_c <- normalize(rho w_c + (1 - rho) mu_c) with mu_c the normalised
    count-weighted mean of the clients' (re-normalised) class means; classes no client holds, and
    the degenerate case rho w_c + (1 - rho) mu_c = 0, keep their prototype."""
    acc = torch.zeros(prototypes.shape, dtype=torch.float64)
    total = torch.zeros(prototypes.shape[0], dtype=torch.float64)
    for mean, count in zip(means, counts, strict=True):
        n = count.to("cpu", torch.float64)
        acc += n[:, None] * F.normalize(mean.to("cpu", torch.float64), dim=1)  # sum_k n_kc mu_kc
        total += n
    seen = total > 0
    mu = F.normalize(acc / total.clamp(min=1.0)[:, None], dim=1)  # mu_c
    mixed = smoothing * prototypes.to(torch.float64) + (1.0 - smoothing) * mu
    norm = mixed.norm(dim=1)
    move = seen & (norm > 1e-12)
    new = prototypes.clone()
    new[move] = (mixed[move] / norm[move, None]).to(prototypes.dtype)
    return new


def class_means(
    model: nn.Module, data: TensorDataset, classes: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(C, d) unit-normalised means of the normalised features per class, zero rows for absent
    classes, and the (C,) int64 counts: one pass in eval mode, without gradients, on clean batches."""
    model.eval()
    sums: torch.Tensor | None = None
    counts = torch.zeros(classes, dtype=torch.int64, device=device)
    with torch.no_grad():
        for start in range(0, len(data), EVAL_BATCH):
            x, y = data.eval_batch(start, start + EVAL_BATCH)
            x, y = x.to(device), y.to(device)
            z = F.normalize(model.extract(x).flatten(1), dim=1)  # type: ignore[operator]
            if sums is None:
                sums = torch.zeros(classes, z.shape[1], dtype=z.dtype, device=device)
            shared.add_rows(sums, y, z)
            counts += torch.bincount(y, minlength=classes)
    if sums is None:
        raise ValueError("an empty dataset has no class means")
    return F.normalize(sums, dim=1), counts  # sum / n_c and then normalised: the code's mu_kc


class PrototypeClassifier(nn.Module):
    """A FedModel's feature extractor followed by FedNH's cosine classifier with fixed prototypes:
    the network a node trains (s a parameter when it is learnt) and the one the coordinator evaluates."""

    prototypes: torch.Tensor  # a buffer

    def __init__(self, body: nn.Module, prototypes: torch.Tensor, scale: torch.Tensor, *, learn_scale: bool) -> None:
        super().__init__()
        self.body = body
        self.register_buffer("prototypes", F.normalize(prototypes.detach(), dim=1))
        value = scale.detach().clone().reshape(1)
        if learn_scale:
            self.scale = nn.Parameter(value)
        else:
            self.register_buffer("scale", value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fednh_logits(self.body.extract(x).flatten(1), self.prototypes, self.scale)  # type: ignore[operator]


class _Trainable(nn.Module):
    """`PrototypeClassifier` as vectorised training stacks it: the body and s (a parameter when learnt),
    the normalised prototypes a plain tensor (no buffer: `fedcore.vectorized.unsupported` refuses
    buffers, which a forward pass might update; these are fixed)."""

    def __init__(self, body: nn.Module, prototypes: torch.Tensor, scale: torch.Tensor, *, learn_scale: bool) -> None:
        super().__init__()
        self.body = body
        self.fixed = F.normalize(prototypes.detach(), dim=1)
        value = scale.detach().clone().reshape(1)
        self.scale: torch.Tensor = nn.Parameter(value) if learn_scale else value

    def load(self, prototypes: torch.Tensor, scale: torch.Tensor) -> None:
        """This round's prototypes and s, in place: the tensors keep their addresses, which a round kept
        from an earlier group reads (`train_group`'s `keep_as`)."""
        with torch.no_grad():
            self.fixed.copy_(F.normalize(prototypes.detach(), dim=1))
            self.scale.copy_(scale.detach().reshape(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fednh_logits(self.body.extract(x).flatten(1), self.fixed, self.scale)  # type: ignore[operator]


# -- the two halves --------------------------------------------------------------------------------


class CoordinatorHalf(base.CoordinatorHalf[Hyperparams]):
    sync_only = (
        "FedNH learns its scale s outside the model group and moves its prototypes by each round's "
        "class means, and neither step has a form for updates trained from different versions"
    )

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.classes, self.dim = shared.model_shape(model, "FedNH")
        generator = torch_generator(hp.prototype_seed, "fednh", "prototypes")
        self.prototypes = initial_prototypes(self.classes, self.dim, hp.init, generator)
        """W, (C, d) unit rows, on the CPU."""
        self.scale = torch.tensor([hp.scale], dtype=torch.float32)
        """s, shape (1,)."""

    def configure_round(self, ctx: base.RoundContext) -> base.Payload:
        return base.Payload(
            tensors={
                "model": self.model.state_dict(),
                "prototypes": {"weight": self.prototypes},
                "scale": {"value": self.scale},
            }
        )

    def update_schema(self) -> dict[str, dict[str, TensorSpec]]:
        schema = {
            "model": schema_of(self.model.state_dict()),
            "class_means": shared.class_means_schema(self.classes, self.dim),
        }
        if self.hp.learn_scale:
            schema["scale"] = {"value": TensorSpec(torch.float32, (1,))}
        return schema

    def evaluation_models(self) -> Mapping[str, nn.Module]:
        return {"global": PrototypeClassifier(self.model, self.prototypes, self.scale, learn_scale=False)}

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        valid = shared.valid_updates(ctx, updates, self._invalid, logger)
        if not valid:
            raise AlgorithmError("no update of this round carries valid FedNH class means", round=ctx.round)
        weights = shared.sample_weights(valid, weighted=self.hp.weighted)
        # the bodies (and s, when it is learnt) as FedAvg averages them
        states = [dict(u.payload.tensors["model"]) for u in valid]
        if self.hp.learn_scale:
            for state, u in zip(states, valid, strict=True):
                state[SCALE_KEY] = u.payload.tensors["scale"]["value"]
        average = dict(self.average(states, base.staleness_weighted(ctx, valid, weights)))
        if self.hp.learn_scale:
            self.scale = average.pop(SCALE_KEY).detach().to("cpu", torch.float32).clone()
        self.model.load_state_dict(average)
        # the prototypes: w_c <- normalize(rho w_c + (1 - rho) mu_c)
        old = self.prototypes
        stats = [u.payload.tensors["class_means"] for u in valid]
        self.prototypes = update_prototypes(
            old, [s["means"] for s in stats], [s["counts"] for s in stats], self.hp.smoothing
        )
        shift = float((1.0 - (old * self.prototypes).sum(dim=1)).mean())
        seen = sum(s["counts"].to("cpu") for s in stats)
        return {
            "train_loss": shared.mean_reported_loss(valid, [float(u.num_samples) for u in valid]),
            "fednh_invalid": float(len(updates) - len(valid)),
            "fednh_classes_seen": float(torch.as_tensor(seen > 0).sum()),
            "fednh_prototype_shift": shift,
            "fednh_scale": float(self.scale[0]),
        }

    def _invalid(self, update: base.NodeUpdate) -> str | None:
        """Why the update's class means (and s) cannot be used, or None: they came over the wire."""
        problem = shared.class_means_problem(update, self.classes, self.dim)
        if problem is not None:
            return problem
        tensors = update.payload.tensors
        means, counts = tensors["class_means"]["means"], tensors["class_means"]["counts"]
        if bool((means[counts > 0].norm(dim=1) == 0).any()):
            return "a zero class mean for a class it holds"
        if self.hp.learn_scale:
            scale = tensors.get("scale", {}).get("value")
            if scale is None or scale.numel() != 1 or not bool(torch.isfinite(scale).all()):
                return "no finite scale"
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"prototypes": self.prototypes, "scale": self.scale}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != {"prototypes", "scale"}:
            raise ValueError(f"FedNH state must hold prototypes and scale, got {sorted(state)[:5]}")
        prototypes, scale = state["prototypes"], state["scale"]
        if tuple(prototypes.shape) != (self.classes, self.dim) or tuple(scale.shape) != (1,):
            raise ValueError(
                f"FedNH state has prototypes {tuple(prototypes.shape)} and scale {tuple(scale.shape)}, "
                f"expected {(self.classes, self.dim)} and (1,)"
            )
        if not (bool(torch.isfinite(prototypes).all()) and bool(torch.isfinite(scale).all())):
            raise ValueError("FedNH state holds non-finite prototypes or scale")
        self.prototypes = prototypes.detach().to("cpu", torch.float32).clone()
        self.scale = scale.detach().to("cpu", torch.float32).clone()


class NodeHalf(base.NodeHalf[Hyperparams]):
    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        shared.load_group(task, "model", model, node_id=self.node_id)
        classes, dim = shared.node_model_shape(model, "FedNH", node_id=self.node_id, round=task.round)
        prototypes = self._tensor(task, "prototypes", "weight", (classes, dim))
        scale = self._tensor(task, "scale", "value", (1,))
        device = next(model.parameters()).device
        # W stays fixed: a buffer of the network trained here, which gets no gradient; s is trained when learnt
        net = PrototypeClassifier(model, prototypes.to(device), scale.to(device), learn_scale=self.hp.learn_scale)
        stats = local_sgd(net, data, task.settings, generator)
        try:
            means, counts = class_means(model, data, classes, device)
        except ValueError as exc:
            raise AlgorithmError(str(exc), node_id=self.node_id, round=task.round) from exc
        tensors = {"model": model.state_dict(), "class_means": {"means": means.float(), "counts": counts}}
        if self.hp.learn_scale:
            tensors["scale"] = {"value": net.scale.detach().float()}
        return base.Payload(tensors=tensors, meta={"loss": stats.loss, "steps": stats.steps})

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """`train` for every member at once: the body and s (when learnt) trained as one vectorised
        computation of FedNH's cosine classifier on the fixed prototypes (`_Trainable`: the same network
        as `PrototypeClassifier`, with the prototypes held outside its parameters and buffers), then each
        member's class means from its own trained body. The `_Trainable` is a spare model of the task's
        (`scratch`), loaded in place each round, so that a later round may train in this one's kept round
        (`keep_as`: its loose tensors' addresses, which it reads)."""
        task = shared.start_group(self, members, model).task
        classes, dim = shared.node_model_shape(model, "FedNH", node_id=self.node_id, round=task.round)
        device = next(model.parameters()).device
        prototypes = self._tensor(task, "prototypes", "weight", (classes, dim)).to(device)
        scale = self._tensor(task, "scale", "value", (1,)).to(device)
        learn = self.hp.learn_scale

        def build() -> _Trainable:
            return _Trainable(model, prototypes, scale, learn_scale=learn)

        # a task with no spare models (a bare TaskInput) builds one for this round alone
        net = (
            build() if task.scratch is base.no_scratch else task.scratch(f"fednh-trainable-{id(model)}-{learn}", build)
        )
        assert isinstance(net, _Trainable) and net.body is model
        net.load(prototypes, scale)
        key = ("fednh", self.hp, net.fixed.data_ptr(), net.scale.data_ptr())
        results = train_vectorized(
            net, [m.data for m in members], task.settings, [m.generator for m in members], keep_as=key
        )
        payloads = []
        for member, (state, stats) in zip(members, results, strict=True):
            body = {name.removeprefix("body."): t for name, t in state.items() if name.startswith("body.")}
            model.load_state_dict(body)
            try:
                means, counts = class_means(model, member.data, classes, device)
            except ValueError as exc:
                raise AlgorithmError(str(exc), node_id=member.half.node_id, round=task.round) from exc
            tensors = {"model": body, "class_means": {"means": means.float(), "counts": counts}}
            if self.hp.learn_scale:
                tensors["scale"] = {"value": state["scale"].detach().float()}
            payloads.append(base.Payload(tensors=tensors, meta={"loss": stats.loss, "steps": stats.steps}))
        return payloads

    def group_refusal(self, model: nn.Module) -> str | None:
        return super().group_refusal(model) or unsupported(model)

    def _tensor(self, task: base.TaskInput, group: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = task.payload.tensors.get(group, {}).get(name)
        if tensor is None or tuple(tensor.shape) != shape or not tensor.is_floating_point():
            raise AlgorithmError(
                f"task carries no usable {group}/{name} of shape {shape}", node_id=self.node_id, round=task.round
            )
        return tensor


SPEC = base.AlgorithmSpec(name="fednh", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
