"""Local training of many nodes at once: one vectorised computation over stacked parameters.

`train_vectorized` gives each of K nodes what `fedcore.training.local_sgd` (plain cross-entropy)
gives it alone, starting from the same model: the parameters of the K nodes are stacked along a
leading dimension and every step is one `torch.func.vmap` over `functional_call` (and one backward
pass through it), so K small forward and backward passes become one batched pass (one bmm or
grouped convolution per layer instead of K small ones, and one Python step instead of K). The
nodes' augmentation runs in one pass as well (`augment_nodes`), each node drawing from its own
generator.

What is reproduced per node, exactly as `local_sgd` does it:
- its own shard and its own generator, drawn in the same order (the epoch's `randperm`, then each
  batch's augmentation), so shuffling and augmentation are those of one-by-one training;
- the trailing-batch rule: a last batch of one sample ends the epoch (unless the shard has one),
  and with ``drop_last`` any last batch short of the batch size (a shard smaller than one batch then
  takes no step, as with a DataLoader);
- shards of different sizes: a node with no batch left at a step does not move (neither do its
  optimizer state and step count). Nodes are kept sorted by their number of steps, longest first,
  so the nodes still training at any step are a prefix of the stack and are updated through a
  slice (a mask by construction, with no gather or scatter);
- last batches of different sizes: batches are padded to the step's largest with copies of the
  node's first sample, weighted 0, and each node's loss is the mean over its own real samples;
- SGD with momentum, weight decay and lr as `torch.optim.SGD` computes them, Adam as
  `torch.optim.Adam` does, and `max_grad_norm` per node as `clip_grad_norm_` computes it.

The results equal one-by-one training within float tolerance, not bitwise: batched matrix
products and grouped convolutions sum in another order than the K separate calls, and the padding
(which depends on the other nodes' batch sizes) changes the shape of those sums. In float64 the
two agree to about 1e-16; in float32 usually to 1e-7, but rounding can be amplified: a near tie in
a max-pool or a ReLU sends one step's gradient to another weight (seen: 7e-5 on one node), and Adam
turns a gradient that is pure rounding into a step of a fraction of lr (tests/fedcore/test_vectorized.py).

Refused (`unsupported` says why; callers then train the nodes one by one): models with BatchNorm,
whose batch statistics would include the padding and whose running statistics are updated in place
inside the forward pass; models with any other buffer, which the forward pass may update as well;
and dropout, which draws from torch's global generator in `local_sgd`, a draw that no vectorised
computation can reproduce node by node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.training import TrainSettings, TrainStats
from fedmq.fedcore.transforms import (
    BatchTransform,
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomRotation,
    ToFloat,
    _draw,
    crop_at,
    pad,
    rotate,
)

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8
_CLIP_EPS = 1e-6  # clip_grad_norm_'s max_norm / (total_norm + 1e-6)


class VectorizeError(ValueError):
    """The model or the request cannot be trained as one vectorised computation; the message says why."""


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot be trained vectorised (see the module docstring), or None when it can."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return (
                f"{name or 'the model'} is a BatchNorm: its batch statistics would include the padding of short"
                " batches and its running statistics are updated inside the forward pass"
            )
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return f"{name} is a dropout layer: local_sgd draws its masks from torch's global generator"
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        return f"the model has buffers ({', '.join(buffers[:3])}) that its forward pass may update"
    return None


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches `local_sgd` trains on per epoch: a trailing batch of one sample is skipped unless n == 1,
    and with `drop_last` any trailing batch short of `batch_size`."""
    full, rest = divmod(n, batch_size)
    if drop_last:
        return full
    return full + (1 if rest > 1 or (rest == 1 and n == 1) else 0)


def node_indices(data: TensorDataset, settings: TrainSettings, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """One node's batch indices in `local_sgd`'s order, each epoch's permutation drawn as it draws it."""
    n = len(data)
    for _ in range(settings.local_epochs):
        order = torch.randperm(n, generator=generator, device=generator.device).to(data.x.device)
        for start in range(0, n, settings.batch_size):
            idx = order[start : start + settings.batch_size]
            if len(idx) == 1 and n > 1:
                break
            if settings.drop_last and len(idx) < settings.batch_size:
                break
            yield idx


_FIXED_STEPS = (ToFloat, Normalize)
_RANDOM_STEPS = (RandomCrop, RandomHorizontalFlip, RandomRotation)


def known_steps(transform: BatchTransform) -> list[BatchTransform] | None:
    """`transform` as a flat list of the steps `augment_nodes` knows, or None if it holds another."""
    if isinstance(transform, Compose):
        flat: list[BatchTransform] = []
        for step in transform.steps:
            inner = known_steps(step)
            if inner is None:
                return None
            flat += inner
        return flat
    return [transform] if isinstance(transform, _FIXED_STEPS + _RANDOM_STEPS) else None


def augment_nodes(
    x: torch.Tensor, sizes: Sequence[int], steps: Sequence[BatchTransform], generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """The nodes' training transform applied once to their batches concatenated in `x` (`sizes[k]`
    rows for node k), each node's random values drawn from its own generator, in the order its own
    call would draw them: image for image (bitwise) what `data.train_batch` gives each node, for a
    fraction of the small operations. It mirrors the random steps of `fedcore.transforms`, which
    tests/fedcore/test_vectorized.py holds it to."""
    nodes = list(zip(generators, sizes, strict=True))
    for step in steps:
        if isinstance(step, RandomCrop):
            x = pad(x, step.padding, step.padding_mode)
            h, w = x.shape[-2:]
            if h < step.size or w < step.size:
                raise ValueError(f"a {step.size}-pixel crop of {h} x {w} padded images")
            tops, lefts = [], []
            for g, n in nodes:  # per node: all its tops, then all its lefts
                tops.append((_draw(g, n, x.device) * (h - step.size + 1)).long().clamp_(max=h - step.size))
                lefts.append((_draw(g, n, x.device) * (w - step.size + 1)).long().clamp_(max=w - step.size))
            x = crop_at(x, torch.cat(tops), torch.cat(lefts), step.size)
        elif isinstance(step, RandomHorizontalFlip):
            flip = torch.cat([_draw(g, n, x.device) < step.p for g, n in nodes])
            x = torch.where(flip.view(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)
        elif isinstance(step, RandomRotation):
            if step.degrees != 0:
                x = rotate(x, torch.cat([(_draw(g, n, x.device) * 2 - 1) * step.degrees for g, n in nodes]))
        else:
            x = step(x, None)  # deterministic: ToFloat, Normalize
    return x


@dataclass
class _Stack:
    """K nodes' trainable parameters and optimizer state, stacked along dimension 0, longest-training first."""

    params: dict[str, torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    """SGD: [momentum buffer]; Adam: [exp_avg, exp_avg_sq]."""

    @classmethod
    def of(cls, model: nn.Module, k: int, settings: TrainSettings, device: torch.device) -> _Stack:
        params = {
            name: p.detach().to(device).unsqueeze(0).repeat(k, *([1] * p.dim()))
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        slots = 2 if settings.optimizer == "adam" else int(settings.momentum != 0)
        return cls(params, {name: [torch.zeros_like(t) for _ in range(slots)] for name, t in params.items()})

    def head(self, a: int) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]]]:
        """Views of the first `a` nodes: updating them in place updates the stack."""
        return {n: t[:a] for n, t in self.params.items()}, {n: [s[:a] for s in v] for n, v in self.state.items()}


def _loss_fn(model: nn.Module, frozen: dict[str, torch.Tensor]) -> Callable[..., torch.Tensor]:
    """One node's mean cross-entropy over its real samples (`mask` 1) of a padded batch."""

    def loss(
        params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, count: torch.Tensor
    ) -> torch.Tensor:
        logits = functional_call(model, {**params, **frozen}, (x,))
        # cross_entropy(reduction="none") written out: under vmap F.cross_entropy runs a Python
        # decomposition that imports sympy on first use (seconds); the values are the same
        nll = -F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        return (nll * mask).sum() / count

    return loss


def _gradients(
    losses_of: Callable[..., torch.Tensor], params: dict[str, torch.Tensor], *batch: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Each node's gradient and loss. Node k's loss depends on its own slice of the stack only, so the
    gradient of the sum of the losses is, slice by slice, each node's own gradient; plain autograd
    through the vmapped forward gives it (torch.func.grad would too, but imports torch._dynamo,
    seconds of start-up)."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    with torch.enable_grad():
        losses = losses_of(leaves, *batch)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True)), losses.detach()


def _concat(parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The parts concatenated on `device`. From CPU data to a GPU they are gathered in pinned memory
    and copied asynchronously (the caching host allocator keeps the buffer until the copy is done)."""
    first = parts[0]
    if first.device == device:
        return torch.cat(list(parts))
    pin = first.device.type == "cpu" and device.type == "cuda"
    rows = sum(len(p) for p in parts)
    out = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device, pin_memory=pin)
    torch.cat(list(parts), out=out)
    return out.to(device, non_blocking=True)


class _Batcher:
    """Each step's batch of the nodes still training: drawn node by node as `local_sgd` draws it,
    augmented in one pass when the nodes share a transform `augment_nodes` knows, and padded to
    ``(nodes, rows, ...)`` with copies of each node's first sample."""

    def __init__(
        self,
        datasets: Sequence[TensorDataset],
        settings: TrainSettings,
        generators: Sequence[torch.Generator],
        device: torch.device,
    ) -> None:
        self.datasets, self.generators, self.device = datasets, generators, device
        self.indices = [node_indices(d, settings, g) for d, g in zip(datasets, generators, strict=True)]
        transform = datasets[0].train_transform
        plain = all(type(d) is TensorDataset and d.train_transform is transform for d in datasets)
        self.steps = (known_steps(transform) if transform is not None else []) if plain else None
        """The shared transform's steps, [] for none; None: each node transforms its own batch."""

    def next(self, active: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The next padded (x, y) of the first `active` nodes, and each one's number of real samples."""
        nodes = range(active)
        idx = [next(self.indices[i]) for i in nodes]
        sizes = [len(i) for i in idx]
        y = _concat([self.datasets[i].y[idx[i]] for i in nodes], self.device)
        if self.steps is None:
            parts = [self.datasets[i].train_batch(idx[i], self.generators[i])[0] for i in nodes]
            x = _concat(parts, self.device)
        else:
            x = _concat([self.datasets[i].x[idx[i]] for i in nodes], self.device)
            x = augment_nodes(x, sizes, self.steps, self.generators[:active]) if self.steps else x
        rows = max(sizes)
        offsets = torch.tensor([0, *sizes[:-1]]).cumsum(0).unsqueeze(1)
        j = torch.arange(rows).unsqueeze(0)
        pos = (torch.where(j < torch.tensor(sizes).unsqueeze(1), j, 0) + offsets).to(x.device)
        return x[pos], y[pos], sizes


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ per node: scale node k's gradients by min(1, max_norm / (||g_k|| + 1e-6))."""
    norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads.values()], dim=1)
    coef = (max_norm / (torch.linalg.vector_norm(norms, dim=1) + _CLIP_EPS)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))


def _sgd(p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], settings: TrainSettings) -> None:
    """torch.optim.SGD's step (dampening 0, no Nesterov); a zero buffer makes the first step buf = g exactly."""
    if settings.weight_decay != 0:
        g = g.add(p, alpha=settings.weight_decay)
    if settings.momentum != 0:
        g = state[0].mul_(settings.momentum).add_(g)
    p.add_(g, alpha=-settings.lr)


def _adam(p: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor], settings: TrainSettings, step: int) -> None:
    """torch.optim.Adam's step with the default betas and eps, in its single-tensor form (the CPU default; on
    a GPU torch's foreach form arranges the same arithmetic differently, within rounding); `step` counts from 1."""
    beta1, beta2 = _ADAM_BETAS
    exp_avg, exp_avg_sq = state
    if settings.weight_decay != 0:
        g = g.add(p, alpha=settings.weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = settings.lr / (1 - beta1**step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(_ADAM_EPS)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def train_vectorized(
    model: nn.Module,
    datasets: Sequence[TensorDataset],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
) -> list[tuple[StateDict, TrainStats]]:
    """Train one copy of `model` per dataset, each as `local_sgd(copy, data, settings, generator)` would
    (within float tolerance), as one vectorised computation; `model` itself is left unchanged.

    Returns per node, in the order given, its state dict (fresh tensors, not aliasing `model`) and
    its TrainStats. Raises VectorizeError for a model `unsupported` refuses.
    """
    reason = unsupported(model)
    if reason is not None:
        raise VectorizeError(reason)
    if len(datasets) != len(generators) or not datasets:
        raise ValueError(f"{len(datasets)} datasets and {len(generators)} generators: one of each per node")
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    steps = [settings.local_epochs * steps_per_epoch(len(d), settings.batch_size, settings.drop_last) for d in datasets]
    order = sorted(range(len(datasets)), key=lambda k: -steps[k])  # stable: longest first, then as given
    stack = _Stack.of(model, len(order), settings, device)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses_of = vmap(_loss_fn(model, frozen))
    batches = _Batcher([datasets[k] for k in order], settings, [generators[k] for k in order], device)
    totals = torch.zeros(len(order), dtype=torch.float64, device=device)
    seen = torch.zeros(len(order), dtype=torch.float64, device=device)
    was_training = model.training
    model.train()
    try:
        for s in range(max(steps)):
            active = sum(1 for k in order if steps[k] > s)
            x, y, counts = batches.next(active)
            sizes = torch.tensor(counts, dtype=torch.float64)
            mask = (torch.arange(x.shape[1]).unsqueeze(0) < sizes.unsqueeze(1)).to(device, dtype)
            params, state = stack.head(active)
            grads, losses = _gradients(losses_of, params, x, y, mask, sizes.to(device, dtype))
            if settings.max_grad_norm is not None:
                _clip(grads, settings.max_grad_norm)
            with torch.no_grad():
                for name, p in params.items():
                    if settings.optimizer == "adam":
                        _adam(p, grads[name], state[name], settings, s + 1)
                    else:
                        _sgd(p, grads[name], state[name], settings)
            totals[:active] += losses.detach().double() * sizes.to(device)
            seen[:active] += sizes.to(device)
    finally:
        model.train(was_training)
    return _results(model, stack, frozen, order, steps, totals.cpu(), seen.cpu())


def _results(
    model: nn.Module,
    stack: _Stack,
    frozen: dict[str, torch.Tensor],
    order: list[int],
    steps: list[int],
    totals: torch.Tensor,
    seen: torch.Tensor,
) -> list[tuple[StateDict, TrainStats]]:
    """Each node's state dict (keys in `model.state_dict()` order) and stats, back in the caller's order."""
    keys = list(model.state_dict())
    by_node: dict[int, tuple[StateDict, TrainStats]] = {}
    for pos, k in enumerate(order):
        state = {name: stack.params[name][pos] if name in stack.params else frozen[name] for name in keys}
        n = float(seen[pos])
        by_node[k] = (state, TrainStats(loss=float(totals[pos]) / max(n, 1), steps=steps[k], samples_seen=int(n)))
    return [by_node[k] for k in range(len(order))]
