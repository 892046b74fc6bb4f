"""KDIA's conditional feature generator and its server-side training (kdia.md 1.6, paper Eq. 3-4).

The generator maps noise and a label to a fake *extractor output* (``model.feature_shape``; 16x5x5
for "moon-cnn"). After each round's aggregation the coordinator trains it so that the ensemble of
the round's uploaded classifier heads, ``sum_k p_k h_k(G(z, y))``, classifies its output as ``y``
(Eq. 3, without the paper's 1/K: spec A2), plus the diversity term of Eq. 4. Nodes then use it,
frozen and in eval mode, to regularise their own head (`kdia.NodeHalf`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from fedmq.fedcore.models.base import FedModel
from fedmq.fedcore.seeding import global_stream
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.vectorized import GRAPHS, run_steps, use_graphs

LEAKY_SLOPE = 0.2
DIVERSITY_EPS = 1e-5
TRUNK_WIDTHS = (512, 256, 128)


class FeatureGenerator(nn.Module):
    """The code's DCGAN-like conditional generator (kdia.md 1.6, spec A6), for any feature shape.

    ``concat(z, Embedding(Nc, Nc)(y))`` as a ``(noise_dim + Nc) x 1 x 1`` map, then three
    ConvTranspose2d(k=2, no bias) -> BatchNorm -> LeakyReLU(0.2) blocks (512, 256, 128 channels;
    1x1 -> 4x4), then the output layer and a Sigmoid, so features lie in (0, 1). For a ``C x H x W``
    target with H, W >= 4 the output layer is ConvTranspose2d(128 -> C, kernel (H-3, W-3), no bias):
    for "moon-cnn"'s 16x5x5 that is the code's fourth k=2 layer, and the parameter counts are the
    spec's (890,724 for 10 classes, 1,084,944 for 100). For any other shape (vectors such as the
    MLP's features, or small maps) it is a bias-free Linear from the flattened 128x4x4 trunk, an
    extension: the paper only uses the 16x5x5 target.
    """

    def __init__(self, noise_dim: int, num_classes: int, feature_shape: Sequence[int]) -> None:
        super().__init__()
        if noise_dim < 1 or num_classes < 1 or not feature_shape or any(int(d) < 1 for d in feature_shape):
            raise ValueError(f"bad generator shape: noise {noise_dim}, {num_classes} classes, {tuple(feature_shape)}")
        self.noise_dim = int(noise_dim)
        self.num_classes = int(num_classes)
        self.feature_shape = tuple(int(d) for d in feature_shape)
        self.embedding = nn.Embedding(num_classes, num_classes)
        layers: list[nn.Module] = []
        width = noise_dim + num_classes
        for out in TRUNK_WIDTHS:
            layers += [
                nn.ConvTranspose2d(width, out, 2, 1, 0, bias=False),
                nn.BatchNorm2d(out),
                nn.LeakyReLU(LEAKY_SLOPE),
            ]
            width = out
        self.trunk = nn.Sequential(*layers)
        side = len(TRUNK_WIDTHS) + 1  # each k=2, s=1 transposed conv grows the map by one: 1x1 -> 4x4
        if len(self.feature_shape) == 3 and min(self.feature_shape[1:]) >= side:
            c, h, w = self.feature_shape
            self.out: nn.Module = nn.ConvTranspose2d(width, c, (h - side + 1, w - side + 1), 1, 0, bias=False)
        else:
            self.out = nn.Sequential(
                nn.Flatten(), nn.Linear(width * side * side, math.prod(self.feature_shape), bias=False)
            )

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Features of shape ``(B, *feature_shape)`` for noise ``(B, noise_dim[, 1, 1])`` and labels ``(B,)``."""
        x = torch.cat([z.reshape(len(z), self.noise_dim), self.embedding(y)], dim=1)[:, :, None, None]
        return torch.sigmoid(self.out(self.trunk(x))).reshape(len(z), *self.feature_shape)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """PyTorch's default initialisation (the code's; its ``weights_init`` is commented out),
        drawn from `generator` instead of the global stream."""
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, generator=generator)
            elif isinstance(module, nn.ConvTranspose2d | nn.Linear):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
            elif isinstance(module, nn.BatchNorm2d):
                module.reset_parameters()


def build_generator(noise_dim: int, model: FedModel) -> FeatureGenerator:
    """A generator for `model`'s features and classes (spec A17: Nc from the model), built without
    touching torch's global random stream (its weights are loaded or re-drawn right after)."""
    with global_stream():
        return FeatureGenerator(noise_dim, model.num_classes, model.feature_shape)


def diversity_loss(z: torch.Tensor, features: torch.Tensor, eps: float = DIVERSITY_EPS) -> torch.Tensor:
    """Eq. 4 in the code's form: split the batch in halves, ``1 / (mean|G1-G2| / mean|z1-z2| + eps)``."""
    half = len(z) // 2
    if half < 1:
        raise ValueError("the diversity loss needs a batch of at least two")
    spread = (features[:half] - features[half : 2 * half]).abs().mean()
    noise = (z[:half] - z[half : 2 * half]).abs().mean()
    return 1.0 / (spread / noise + eps)


class _Classify(nn.Module):
    """``model.classify`` as a module's forward, for `functional_call`."""

    def __init__(self, model: FedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.classify(h)


class HeadEnsemble:
    """``sum_k p_k h_k(features)``: K frozen classifier heads, resident on one device (Eq. 3, no 1/K).

    `batched` stacks the heads' weights and runs them as one vmapped call (one batched matmul per
    layer instead of K small ones); otherwise a loop over K module copies. Heads run in eval mode.
    """

    def __init__(
        self,
        model: FedModel,
        states: Sequence[Mapping[str, torch.Tensor]],
        weights: Sequence[float],
        device: torch.device,
        *,
        batched: bool = True,
    ) -> None:
        if not states or len(states) != len(weights):
            raise ValueError("the ensemble needs one weight per head, and at least one head")
        total = float(sum(weights))
        self.weights = torch.tensor([float(w) / total for w in weights], dtype=torch.float32, device=device)
        keys = model.head_keys() or list(model.state_dict())
        self.batched = batched
        base = copy.deepcopy(model).to(device).eval().requires_grad_(False)
        if batched:
            self.shell = _Classify(base)
            self.params = {f"model.{k}": torch.stack([s[k] for s in states]).to(device) for k in keys}
            self._call = torch.vmap(self._one, in_dims=(0, None))
        else:
            self.heads = []
            for state in states:
                head = copy.deepcopy(base)
                head.load_state_dict({k: state[k] for k in keys}, strict=False)
                self.heads.append(head)

    def _one(self, params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return functional_call(self.shell, params, (h,), strict=False)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        if self.batched:
            logits = self._call(self.params, features)  # (K, B, Nc)
            return torch.einsum("k,kbc->bc", self.weights, logits)
        out = self.weights[0] * self.heads[0].classify(features)
        for w, head in zip(self.weights[1:], self.heads[1:], strict=True):
            out = out + w * head.classify(features)
        return out


@dataclass(frozen=True, slots=True)
class GeneratorStats:
    ce: float
    """Mean ensemble cross-entropy over the round's steps."""
    diversity: float
    """Mean diversity loss (Eq. 4) over the round's steps."""
    steps: int
    seconds: float


def train_generator(
    generator: FeatureGenerator,
    ensemble: HeadEnsemble,
    *,
    epochs: int,
    batches_per_epoch: int,
    batch_size: int,
    lr: float,
    weight_decay: float,
    rng: torch.Generator,
    device: torch.device,
    optimizer_state: Mapping[str, Any] | None = None,
    graphs: str | None = None,
) -> tuple[GeneratorStats, dict[str, Any]]:
    """One round of generator training (kdia.md 1.6 "Server training loop", Algorithm 1 l.13-18).

    A label pool of ``batches_per_epoch x batch_size`` uniform labels is drawn once (spec A3);
    each epoch shuffles it and takes `batch_size` labels per step with fresh noise ``z ~ N(0, I)``.
    Every draw comes from `rng` (on the CPU, so the result does not depend on `device`), all of them
    before the first step (`generator_draws`) and moved to the device at once, so that the steps wait
    for no host copy; on a CUDA device all steps but the first three are replays of one captured CUDA
    graph (`graphs`: auto, on, off; default: `fedcore.vectorized.graph_mode`'s), the tiny generator's
    steps being bound by kernel launches, and Adam is torch's fused kernel (`fused_adam`) for the same
    reason. Adam is re-created each round (spec A4) unless
    `optimizer_state` (the previous round's) is given. Returns the statistics and the optimiser's state.
    """
    generator.to(device).train()
    captured = use_graphs(device, graphs or GRAPHS.get())
    # a captured Adam keeps its step count on the device (capturable): its bias corrections are tensors
    optimizer = torch.optim.Adam(
        generator.parameters(), lr=lr, weight_decay=weight_decay, capturable=captured, fused=fused_adam(device)
    )
    if optimizer_state is not None:
        optimizer.load_state_dict(dict(optimizer_state))
    started = time.perf_counter()
    labels, noise = generator_draws(
        epochs=epochs,
        batches_per_epoch=batches_per_epoch,
        batch_size=batch_size,
        noise_dim=generator.noise_dim,
        num_classes=generator.num_classes,
        rng=rng,
    )
    labels, noise = labels.to(device), noise.to(device)
    ce_sum = torch.zeros((), device=device)
    div_sum = torch.zeros((), device=device)
    # the step's inputs, at fixed addresses (what a captured graph reads)
    y, z = labels.new_zeros(labels.shape[1:]), noise.new_zeros(noise.shape[1:])

    def step() -> None:
        # the gradients set to None, not zeroed: a captured step makes them inside the graph, so that each
        # replay writes them afresh rather than adding to the last step's
        optimizer.zero_grad(set_to_none=True)
        features = generator(z, y)
        # Eq. 3: CE of the p_k-weighted sum of the frozen heads' logits; Eq. 4: diversity
        ce = F.cross_entropy(ensemble(features), y)
        div = diversity_loss(z, features)
        (ce + div).backward()
        optimizer.step()  # only the generator's parameters: the heads are frozen
        ce_sum.add_(ce.detach())
        div_sum.add_(div.detach())

    def load(s: int) -> None:
        y.copy_(labels[s])
        z.copy_(noise[s])

    steps = len(labels)
    run_steps(steps, load, lambda _: step(), lambda _: step(), captured)
    n = max(steps, 1)
    stats = GeneratorStats(
        ce=float(ce_sum) / n, diversity=float(div_sum) / n, steps=steps, seconds=time.perf_counter() - started
    )
    return stats, optimizer.state_dict()


FUSED_ADAM_DEVICES = frozenset({"cpu", "cuda"})
"""Where the generator's Adam is torch's fused kernel (one pass over every parameter, its gradient and
both moments, where the default form takes a dozen operators a parameter on a CPU and a dozen
multi-tensor launches on a GPU): the devices fedmq runs on that have it."""


def fused_adam(device: torch.device) -> bool:
    """Whether the generator's Adam on `device` is torch's fused one (the same update, other last bits)."""
    return device.type in FUSED_ADAM_DEVICES


def generator_draws(
    *, epochs: int, batches_per_epoch: int, batch_size: int, noise_dim: int, num_classes: int, rng: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every step's labels ``(S, B)`` and noise ``(S, B, noise_dim, 1, 1)``, drawn from `rng` in the
    order the round's loop uses them: the label pool once, then per epoch its permutation and each
    step's noise."""
    pool = torch.randint(0, num_classes, (batches_per_epoch * batch_size,), generator=rng)
    labels, noise = [], []
    for _ in range(epochs):
        pool = pool[torch.randperm(len(pool), generator=rng)]
        for b in range(batches_per_epoch):
            labels.append(pool[b * batch_size : (b + 1) * batch_size])
            noise.append(torch.randn(batch_size, noise_dim, 1, 1, generator=rng))
    if not labels:
        return torch.zeros((0, batch_size), dtype=torch.long), torch.zeros((0, batch_size, noise_dim, 1, 1))
    return torch.stack(labels), torch.stack(noise)


def generator_state(generator: FeatureGenerator) -> StateDict:
    """The generator's parameters and BatchNorm buffers on the CPU, as the task message carries them."""
    return {k: v.detach().cpu() for k, v in generator.state_dict().items()}
