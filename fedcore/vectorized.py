"""Local training of many nodes at once: one vectorised computation over stacked parameters.

`train_vectorized` gives each of K nodes what `fedcore.training.local_sgd` gives it alone on the
method's objective (`GroupObjective`; the cross-entropy by default), starting from the same model: the
parameters of the K nodes are stacked along a leading dimension and every step is one `torch.func.vmap`
over `functional_call` (and one backward pass through it), so K small forward and backward passes
become one batched pass. Every draw of the round is made before the steps that read it (`_plan`), so
the steps read only device buffers: on a CPU all before the first step, on a CUDA device in chunks,
each drawn by the host while the device trains the steps before it (`PIPELINE`); on a CUDA device all
but the first three steps of each kind (every node training, or some masked) are replays of that
kind's captured CUDA graph (`graphs`).

What is reproduced per node, exactly as `local_sgd` does it:
- its own shard and its own generator, drawn in the same order (the epoch's `randperm`, then each
  batch's augmentation, then what the objective draws: `StepDraws`), so shuffling and augmentation
  are those of one-by-one training, bitwise;
- the trailing-batch rule: a last batch of one sample ends the epoch (unless the shard has one),
  and with ``drop_last`` any last batch short of the batch size (a shard smaller than one batch then
  takes no step, as with a DataLoader);
- shards of different sizes: a node with no batch left at a step does not move (neither do its
  optimizer state and step count). Nodes are sorted by their number of steps, longest first; eager
  steps train the prefix still training, unmasked; a captured step trains all K, and once some have
  no batch left restores theirs after the update;
- batches short of the batch size are padded to it with copies of the node's first sample of the
  batch, weighted 0, and each node's loss is the mean over its own real samples;
- SGD with momentum, weight decay and lr as `torch.optim.SGD` computes them (the lr read from the
  device, as its capturable form reads it: the update is g x -lr then added, one rounding more than
  its alpha=-lr), Adam as `torch.optim.Adam` does, and `max_grad_norm` per node as
  `clip_grad_norm_` computes it.

The results equal one-by-one training within float tolerance, not bitwise: batched matrix
products and grouped convolutions sum in another order than the K separate calls, and the padding
(which depends on the other nodes' batch sizes) changes the shape of those sums. In float64 the
two agree to about 1e-16; in float32 usually to 1e-7, but rounding can be amplified: a near tie in
a max-pool or a ReLU sends one step's gradient to another weight (seen: 7e-5 on one node), and Adam
turns a gradient that is pure rounding into a step of a fraction of lr (tests/fedcore/test_vectorized.py).

BatchNorm, on FedAvg's objective (`cross_entropy_objective`: the model run once a step on the node's own
parameters): each BatchNorm runs as `fedcore.masked_norm.MaskedBatchNorm`, its batch statistics over
the node's real samples only, and each node keeps its own running statistics and batch count (stacked
like the parameters, handed back by each step and kept for the nodes that trained at it). In float64 a
node's weights, running statistics and counts are its `local_sgd`'s to 1e-12 with SGD
(tests/fedcore/test_vectorized_batch_norm.py).

Refused (`unsupported` says why; callers then train the nodes one by one): BatchNorm with any other
objective (it may run the model more than once a step, or the global model's statistics); models with
any other buffer, which the forward pass may update as well; and dropout, which draws from torch's
global generator in `local_sgd`, a draw that no vectorised computation can reproduce node by node.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.profiler import record_function

from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.layers_over_nodes import negative_log_likelihood, over_nodes
from fedmq.fedcore.masked_norm import (
    TORCH_AT_WHOLE_BATCHES,
    NormStep,
    has_batch_norm,
    masked_norms,
    update_running_statistics,
)
from fedmq.fedcore.packed import Packed
from fedmq.fedcore.round_plan import (
    BATCH_ROOM,
    LABELS_ROOM,
    BatchOutput,
    BatchRoom,
    StepDraws,
    _ahead,
    _draws_of,
    _pipelined,
    _Plan,
    _plan,
    _random_ops,
    holding,
    steps_per_epoch,
    whole_batch_steps,
)
from fedmq.fedcore.seeding import global_stream_layer
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.training import TrainSettings, TrainStats, autocast
from fedmq.fedcore.transforms import (
    BatchTransform,
    Compose,
    CropTables,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomRotation,
    ToFloat,
    crop_tables,
    padded_crop_at,
    rotate,
)

_ADAM_BETAS = (0.9, 0.999)
_ADAM_EPS = 1e-8
_CLIP_EPS = 1e-6  # clip_grad_norm_'s max_norm / (total_norm + 1e-6)


class VectorizeError(ValueError):
    """The model or the request cannot be trained as one vectorised computation; the message says why."""


def unsupported(model: nn.Module, batch_norm: bool = False) -> str | None:
    """Why `model` cannot be trained vectorised (see the module docstring), or None when it can;
    `batch_norm`: on FedAvg's objective, which trains BatchNorm as `fedcore.masked_norm` does."""
    norms = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            if not batch_norm:
                return (
                    f"{name or 'the model'} is a BatchNorm, which vectorised training runs for FedAvg's node"
                    " objective only (fedcore.masked_norm): another objective may run the model more than once"
                    " a step, or another model's statistics"
                )
            norms |= {f"{name}.{b}" if name else b for b, _ in module.named_buffers(recurse=False)}
    drawing = global_stream_layer(model)
    if drawing is not None:
        return f"{drawing}: local_sgd draws its random values from torch's global generator"
    buffers = [name for name, _ in model.named_buffers() if name not in norms]
    if buffers:
        return f"the model has buffers ({', '.join(buffers[:3])}) that its forward pass may update"
    return None


OUTPUT_ROWS = 8192
"""About how many samples a `BatchOutput` is made for at once on a GPU (`_Round._fill_outputs`): large
batches, few launches, and a bounded share of memory for their augmented inputs (CIFAR's: 100 MB in
float32). On a CPU, one step's batch at a time: larger ones leave the caches (8,192 samples a call made
a round of KDIA's vectorised training 15-20% slower on the 2-core CPU, 2026-11-29)."""
CPU_OUTPUT_ROWS = 0
"""`OUTPUT_ROWS` elsewhere than on a CUDA device; below a step's batch, a step's batch at a time."""
BATCH_AHEAD_BYTES = 2 << 30
"""The most a round's augmented batches may take on the device to be made before the steps
(`round_plan.BATCH_ROOM`): they stay there until the round ends. A KDIA round of CIFAR-10 takes about
600 MB; a round of larger images or more of them makes each step's batch in the step, as before."""

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
    call would draw them: image for image (bitwise) what `data.train_batch` gives each node. The same
    drawing (`_draws_of`) and application (`_apply_steps`) as a vectorised step's, which
    tests/fedcore/test_vectorized.py holds to `fedcore.transforms`."""
    ops = _random_ops(steps, _image_size(x))
    per_node = [_draws_of(ops, g, n) for g, n in zip(generators, sizes, strict=True)]
    draws = [torch.cat([values[j] for values in per_node]).to(x.device) for j in range(len(ops))]
    return _apply_steps(x, steps, draws, _constants(steps, x.device, _image_size(x)))


def _image_size(x: torch.Tensor) -> tuple[int, int]:
    """The height and width of a batch (or dataset) of images; (0, 0) for other data."""
    return (x.shape[-2], x.shape[-1]) if x.dim() >= 3 else (0, 0)


Constants = dict[int, "tuple[torch.Tensor, ...] | CropTables"]
"""`_constants`: each fixed step's tensors, by the step's position."""


def _constants(steps: Sequence[BatchTransform], device: torch.device, image: tuple[int, int]) -> Constants:
    """The fixed steps' tensors on `device`, made once: each Normalize step's mean and std, each ToFloat's
    divisor (with, when a Normalize follows it, their `_pixel_table`), each RandomCrop's windows
    (`CropTables`, for the `image` size that reaches it). A captured graph cannot copy them from the host
    at every step, as `Normalize.__call__` does, and a step need not remake them."""
    made: Constants = {}
    height, width = image
    for i, step in enumerate(steps):
        if isinstance(step, RandomCrop):
            made[i] = crop_tables(height, width, step.size, step.padding, step.padding_mode, device)
            height = width = step.size
        elif isinstance(step, Normalize):
            mean = torch.tensor(step.mean, device=device).view(1, -1, 1, 1)
            made[i] = (mean, torch.tensor(step.std, device=device).view(1, -1, 1, 1))
        elif isinstance(step, ToFloat):
            divisor = step.divisor(device)
            following = steps[i + 1] if i + 1 < len(steps) else None
            made[i] = (
                (divisor, _pixel_table(step, following, divisor)) if isinstance(following, Normalize) else (divisor,)
            )
    return made


def _pixel_table(to_float: ToFloat, normalize: Normalize, divisor: torch.Tensor) -> torch.Tensor:
    """What ToFloat then Normalize make of each uint8 value in each channel, a (C, 256) table: a step
    looks its pixels up (`_looked_up`) instead of a conversion, a division, a subtraction and a division
    (two operators fewer). The table is made by the same operators on the same float32 values, so each
    entry is, bit for bit, what the four give."""
    values = to_float.apply(torch.arange(256, dtype=torch.uint8, device=divisor.device), divisor)
    channels = len(normalize.mean)
    mean = torch.tensor(normalize.mean, device=divisor.device).view(channels, 1)
    std = torch.tensor(normalize.std, device=divisor.device).view(channels, 1)
    return (values.view(1, -1) - mean.to(values.dtype)) / std.to(values.dtype)


def _looked_up(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) uint8 `pixels` through their channel's row of `table`: the pixels as indices (one
    conversion) and one gather along the table's rows, seen at every (N, C, H) without a copy. Advanced
    indexing (``table[channels, pixels]``) is the same lookup and was 5 times slower on a CPU (6.1 ms
    against 1.1 for 640 CIFAR images, one thread; the four operators it replaces took 1.2)."""
    n, c, h, _ = pixels.shape
    return table.view(1, c, 1, -1).expand(n, c, h, table.shape[-1]).gather(3, pixels.long())


# -- what a node's loss sees inside the vectorised step --------------------------------------------


@dataclass(frozen=True, slots=True)
class NodeBatch:
    """One node's view of a step, inside the map over nodes: its parameters, its padded batch (weight
    1 for a real sample, 0 for padding), the model every node of the group started from, and the
    node's own tensors (`inputs`, e.g. its label counts). A `GroupObjective` turns it into the node's
    mini-batch loss with tensor operations only (no Python branching on values), so that one function
    serves every node and the whole step can be captured as a CUDA graph."""

    forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]
    params: dict[str, torch.Tensor]
    start: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor
    count: torch.Tensor
    inputs: dict[str, torch.Tensor]
    step: dict[str, torch.Tensor] = field(default_factory=dict)
    """This node's values drawn for this step (`StepDraws`), one row per sample of the batch."""
    carry: dict[str, torch.Tensor] = field(default_factory=dict)
    """This node's carried state as its previous step left it (`train_vectorized`'s `carry`)."""
    share: torch.Tensor | None = None
    """`weight` / `count`, each real sample's share of the mean (`mean`), made once in the round's plan."""

    def logits(self) -> torch.Tensor:
        """The node's model on its batch."""
        return self.forward(self.params, self.x)

    def mean(self, per_sample: torch.Tensor) -> torch.Tensor:
        """The mean of a per-sample quantity over the node's real samples (what F.cross_entropy's mean is):
        weighted by `share` when given (two kernels forward and one backward fewer than a division)."""
        if self.share is not None:
            return (per_sample * self.share).sum()
        return (per_sample * self.weight).sum() / self.count

    def means(self, per_sample: torch.Tensor) -> torch.Tensor:
        """(T,) the `mean` of each of T per-sample quantities, (T, B), at once: the operators of one mean
        for a loss of several terms, where a `mean` a term would take two each way."""
        if self.share is not None:
            return (per_sample * self.share).sum(-1)
        return (per_sample * self.weight).sum(-1) / self.count


GroupObjective = Callable[
    [NodeBatch],
    "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"
    " | tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]",
]
"""A node's mini-batch loss as a pure function of its `NodeBatch` (see there); with a dict of named
terms beside it, each scalar term is averaged over the node's steps (`TrainStats.terms`) and each
tensor term summed over them (`TrainStats.sums`); with a third dict, the node's carried state after
the step (`NodeBatch.carry` at its next step; FedACD's running estimate of P). The carried state is
read as a constant: no gradient flows through it from one step to the next."""


def nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy (`fedcore.layers_over_nodes.negative_log_likelihood`): under vmap
    F.cross_entropy runs a Python decomposition that imports sympy on first use (seconds) and dispatches
    more operators; the values are the same."""
    return negative_log_likelihood(logits, y)


def trained_sample(data: TensorDataset, device: torch.device) -> torch.Tensor:
    """(1, ...) the first sample of `data` on `device` as its training transform gives it (without a
    generator it draws nothing): the shape and dtype a step's batch has, to make room for what it reads."""
    x = data.x[:1].to(device)
    return data.train_transform(x, None) if data.train_transform is not None else x


def _batch_room(data: TensorDataset, device: torch.device, samples: int) -> BatchRoom | None:
    """The room a step's batch takes in the plan (`round_plan.BATCH_ROOM`, `LABELS_ROOM`); None where a
    round's `samples` (every step's rows) would take more than `BATCH_AHEAD_BYTES`."""
    made = trained_sample(data, device)
    if samples * made[0].nbytes > BATCH_AHEAD_BYTES:
        return None
    return BatchRoom(tuple(made.shape[1:]), made.dtype, data.y.dtype)


def take_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]`` for a 1-d `index` into `t`'s first dimension, as one gather: under vmap an index by a
    mapped tensor is two operators (an arange over the nodes, then the index), and a gather is one."""
    return torch.gather(t, 0, index.view(-1, *(1,) * (t.dim() - 1)).expand(len(index), *t.shape[1:]))


def weighted_sum(first: torch.Tensor, *weighted: tuple[float, torch.Tensor]) -> torch.Tensor:
    """``first + w_1 t_1 + w_2 t_2 + ...``, each term added with its weight in one operator (`add`'s alpha).
    Under vmap a Python number times a tensor is two operators, the number made a tensor and the product
    (on a GPU a kernel), and its backward no cheaper. A loss whose terms are means over the same rows is
    best summed per sample and averaged once (`NodeBatch.mean`): one mean's operators, forward and
    backward, instead of one a term."""
    for weight, term in weighted:
        first = first.add(term, alpha=weight)
    return first


class _Method(nn.Module):
    """``model.<name>`` as a module's forward: `functional_call` calls only ``forward``."""

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model, self.name = model, name

    def forward(self, *args: torch.Tensor) -> object:
        return getattr(self.model, self.name)(*args)


def functional_method(model: nn.Module, name: str) -> Callable[[dict[str, torch.Tensor], torch.Tensor], object]:
    """``model.<name>(x)`` (``represent``, ``forward_taps``) run on the parameters given, as
    `NodeBatch.forward` runs ``model(x)``: for an objective that needs more than the logits. A parameter
    not given is the model's own (its frozen ones, which every node shares)."""
    wrapper = _Method(over_nodes(model), name)  # a GroupNorm as one over the nodes (`fedcore.layers_over_nodes`)

    def call(params: dict[str, torch.Tensor], x: torch.Tensor) -> object:
        return functional_call(wrapper, {f"model.{n}": p for n, p in params.items()}, (x,))

    return call


def cross_entropy_objective(batch: NodeBatch) -> torch.Tensor:
    """FedAvg's objective: the mean cross-entropy over the node's real samples."""
    return batch.mean(nll(batch.logits(), batch.y))


def _apply_steps(
    x: torch.Tensor,
    steps: Sequence[BatchTransform],
    draws: Sequence[torch.Tensor],
    constants: Constants,
) -> torch.Tensor:
    """The transform's steps on a flat batch with the values drawn beforehand (`_draws_of`'s order):
    what each node's own call gives, bitwise, with no draw and no host tensor inside (capturable). A flip
    right after a crop is done by the crop's gather."""
    values = iter(draws)
    folded = False
    for i, step in enumerate(steps):
        if folded:  # a flip the crop before it made in its gather, or a Normalize ToFloat's table made
            folded = False
        elif isinstance(step, RandomCrop):
            top, left = next(values), next(values)
            folded = i + 1 < len(steps) and isinstance(steps[i + 1], RandomHorizontalFlip)
            flip = next(values) if folded else None  # the flip's values follow the crop's
            tables = cast(CropTables, constants[i])
            x = padded_crop_at(x, top, left, step.size, step.padding, step.padding_mode, flip, tables)
        elif isinstance(step, RandomHorizontalFlip):
            x = torch.where(next(values).view(-1, *([1] * (x.dim() - 1))), x.flip(-1), x)
        elif isinstance(step, RandomRotation):
            if step.degrees != 0:
                x = rotate(x, next(values))
        elif isinstance(step, Normalize):
            mean, std = cast(tuple[torch.Tensor, torch.Tensor], constants[i])
            x = (x - mean.to(x.dtype)) / std.to(x.dtype)
        elif isinstance(step, ToFloat):  # the last of the steps `known_steps` admits
            divisor, *table = cast(tuple[torch.Tensor, ...], constants[i])
            folded = bool(table) and x.dtype == torch.uint8 and x.dim() == 4  # and the Normalize after it
            x = _looked_up(x, table[0]) if folded else step.apply(x, divisor)
    return x


# -- the stacked nodes and their optimizer -----------------------------------------------------------


@dataclass
class _Stack:
    """K nodes' trainable parameters and optimizer state, stacked along dimension 0."""

    params: dict[str, torch.Tensor]
    state: dict[str, list[torch.Tensor]]
    """SGD: [momentum buffer]; Adam: [exp_avg, exp_avg_sq]."""
    step: torch.Tensor
    """(K,) optimizer steps taken by each node (Adam's bias correction)."""

    @classmethod
    def of(
        cls,
        model: nn.Module,
        k: int,
        settings: TrainSettings,
        device: torch.device,
        starts: Sequence[Mapping[str, torch.Tensor]] | None = None,
    ) -> _Stack:
        """`model`'s trainable parameters repeated K times, or each node's own in `starts` (in stack order)."""
        params = cls.params_of(model, k, device, starts)
        slots = 2 if settings.optimizer == "adam" else int(settings.momentum != 0)
        state = {name: [torch.zeros_like(t) for _ in range(slots)] for name, t in params.items()}
        dtype = next(iter(params.values())).dtype if params else torch.float32
        return cls(params, state, torch.zeros(k, dtype=dtype, device=device))

    @staticmethod
    def params_of(
        model: nn.Module,
        k: int,
        device: torch.device,
        starts: Sequence[Mapping[str, torch.Tensor]] | None,
        views: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The stacked parameters: `model`'s K times, or each node's own in `starts`; `views`: `model`'s as
        K views of one tensor (what a kept round's reset copies from, with no K-fold copy made first)."""
        return {
            name: (
                (
                    p.detach().to(device).unsqueeze(0).expand(k, *p.shape)
                    if views
                    else p.detach().to(device).unsqueeze(0).repeat(k, *([1] * p.dim()))
                )
                if starts is None
                else torch.stack([start[name].detach().to(device, p.dtype) for start in starts])
            )
            for name, p in model.named_parameters()
            if p.requires_grad
        }

    def head(self, a: int) -> tuple[dict[str, torch.Tensor], dict[str, list[torch.Tensor]], torch.Tensor]:
        """Views of the first `a` nodes: updating them in place updates the stack."""
        return (
            {n: t[:a] for n, t in self.params.items()},
            {n: [s[:a] for s in v] for n, v in self.state.items()},
            self.step[:a],
        )


def _stacked_buffers(model: nn.Module, k: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`model`'s buffers (BatchNorm's running statistics) repeated K times: each node's own from here on."""
    return {name: b.detach().to(device).unsqueeze(0).repeat(k, *([1] * b.dim())) for name, b in model.named_buffers()}


def _per_node(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (K,) tensor shaped to broadcast over a stacked (K, ...) parameter."""
    return v.view(-1, *([1] * (like.dim() - 1)))


Outputs = tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""Each node's loss, named terms, carried state after a step and its BatchNorms' batch statistics, stacked over
the nodes."""


class _Seeds:
    """The backward pass's seed, ones over the nodes, made once a round for each dtype a loss comes in:
    autograd from the losses with these as their gradients is autograd from their sum, without the sum
    and the ones that each step made (two operators). Made at the first (eager) step of a round, before
    any graph is captured."""

    def __init__(self, k: int, device: torch.device) -> None:
        self.k, self.device = k, device
        self.made: dict[torch.dtype, torch.Tensor] = {}

    def of(self, losses: torch.Tensor) -> torch.Tensor:
        ones = self.made.get(losses.dtype)
        if ones is None:
            ones = self.made[losses.dtype] = torch.ones(self.k, dtype=losses.dtype, device=self.device)
        return ones[: len(losses)]


def _gradients(
    losses_of: Callable[..., Outputs], params: dict[str, torch.Tensor], *batch: object, seeds: _Seeds
) -> tuple[
    dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]
]:
    """Each node's gradient, loss, named terms, carried state after the step and batch statistics. Node k's loss depends
    on its own slice of the stack only, so the gradient of the sum of the losses is, slice by slice, each
    node's own gradient; plain autograd through the vmapped forward gives it (torch.func.grad would
    too, but imports torch._dynamo, seconds of start-up)."""
    leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
    with torch.enable_grad():
        losses, terms, after, statistics = losses_of(leaves, *batch)
        grads = torch.autograd.grad(losses, list(leaves.values()), seeds.of(losses), allow_unused=True)
    # a parameter the objective does not use has no gradient, and is left as torch's optimisers leave one
    used = {name: g for name, g in zip(leaves, grads, strict=True) if g is not None}
    detached = {n: t.detach() for n, t in terms.items()}
    return (
        used,
        losses.detach(),
        detached,
        {n: t.detach() for n, t in after.items()},
        {n: t.detach() for n, t in statistics.items()},
    )


def _clip(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """clip_grad_norm_ per node: scale node k's gradients by min(1, max_norm / (||g_k|| + 1e-6)), as torch's
    foreach form does it: the norm of every node's slice of every gradient in one multi-tensor operation,
    and each node's slices scaled in one, where a norm and a product per parameter took two operators a
    parameter (125 of FedRCL's ResNet-18's 306 a step)."""
    tensors = list(grads.values())
    if not tensors:
        return
    k = tensors[0].shape[0]
    slices = [node for g in tensors for node in g.unbind(0)]  # parameter by parameter, node by node
    norms = torch.stack(torch._foreach_norm(slices)).view(len(tensors), k)
    coef = (max_norm / (torch.linalg.vector_norm(norms, dim=0) + _CLIP_EPS)).clamp(max=1.0)
    for node, scale in enumerate(coef.unbind(0)):
        torch._foreach_mul_(slices[node::k], scale)


def _sgd_all(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    settings: TrainSettings,
    lr: _LearningRate,
) -> None:
    """torch.optim.SGD's step for every node of the stack at once, for a step in which no node is masked.
    `bufs` is empty without momentum; they start at zero, so the first step's `0 * momentum + g` is torch's
    copy of g. The lr is read from the device (`lr`), as torch's capturable optimisers read it, so that a
    captured step serves every lr (a decaying lr, FedRCL's epochs). The gradients are this step's own.

    In torch's fused form (`fused=True`) where it applies (`_fused`): one kernel reads each parameter,
    gradient and momentum buffer once and writes the parameter and buffer, where the multi-tensor form's
    weight decay, momentum and update pass over them five times (on a GPU five kernels; for a ResNet-18 a
    fifth of a step's memory traffic). Its rounding may differ from the other forms' in the last bit (a
    fused multiply-add)."""
    if _fused(params, bufs):
        torch._fused_sgd_(
            params,
            [g if g.is_contiguous() else g.contiguous() for g in grads],  # the kernel reads them as laid out
            bufs,
            weight_decay=settings.weight_decay,
            momentum=settings.momentum,
            lr=lr.fused,
            dampening=0.0,
            nesterov=False,
            maximize=False,
            is_first_step=False,
        )
        return
    if settings.weight_decay != 0:
        torch._foreach_add_(grads, params, alpha=settings.weight_decay)
    update = grads
    if settings.momentum != 0:
        torch._foreach_mul_(bufs, settings.momentum)
        torch._foreach_add_(bufs, grads)
        update = bufs
    torch._foreach_add_(params, torch._foreach_mul(update, lr.negative))


def _fused(params: list[torch.Tensor], bufs: list[torch.Tensor]) -> bool:
    """Whether torch's fused SGD kernel steps these tensors: it reads every tensor as contiguous memory
    (on a CPU a transposed gradient gives silently wrong weights: hence the gradients made contiguous),
    and on a CUDA device it reads a device lr as float32, which would round a float64 model's lr (its
    float64 agreement with `local_sgd`, 1e-12, would not hold): such models keep the multi-tensor form."""
    if not params or not all(t.is_contiguous() for t in (*params, *bufs)):
        return False
    return params[0].device.type != "cuda" or params[0].dtype != torch.float64


@dataclass(frozen=True)
class _LearningRate:
    """A round's lr on its device, where a captured step reads it: a kept round's next call (another
    round's decayed lr, FedRCL's next epoch) sets it in place (`set`) instead of capturing anew."""

    fused: torch.Tensor
    """lr as SGD's fused kernel reads it: float32 on a CUDA device, else in the parameters' dtype."""
    negative: torch.Tensor
    """-lr in the parameters' dtype (SGD's multi-tensor update, as torch.optim.SGD's alpha=-lr rounds it)."""
    exact: torch.Tensor
    """lr in float64 (Adam's step size, as torch computes it from its Python lr)."""

    @classmethod
    def of(cls, lr: float, dtype: torch.dtype, device: torch.device) -> _LearningRate:
        return cls(
            torch.full((), lr, dtype=torch.float32 if device.type == "cuda" else dtype, device=device),
            torch.full((), -lr, dtype=dtype, device=device),
            torch.full((), lr, dtype=torch.float64, device=device),
        )

    def set(self, lr: float) -> None:
        self.fused.fill_(lr)
        self.negative.fill_(-lr)
        self.exact.fill_(lr)


def _adam(
    p: torch.Tensor,
    g: torch.Tensor,
    state: list[torch.Tensor],
    active: torch.Tensor,
    step: torch.Tensor,
    settings: TrainSettings,
    lr: _LearningRate,
) -> None:
    """torch.optim.Adam's step with the default betas and eps, in its single-tensor form, for the active
    nodes (`step` counts each node's steps from 1; the others keep everything)."""
    beta1, beta2 = _ADAM_BETAS
    exp_avg, exp_avg_sq = state
    on = _per_node(active, p) > 0
    if settings.weight_decay != 0:
        g = g.add(p, alpha=settings.weight_decay)
    exp_avg.copy_(torch.where(on, exp_avg.lerp(g, 1 - beta1), exp_avg))
    exp_avg_sq.copy_(torch.where(on, exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2), exp_avg_sq))
    # the bias corrections in float64, as torch computes them from its Python step count
    t = _per_node(step.clamp(min=1).double(), p)
    step_size = ((1 - beta1**t).reciprocal() * lr.exact).to(p.dtype)  # lr / (...) as torch computes it
    denom = (exp_avg_sq.sqrt() / (1 - beta2**t).sqrt().to(p.dtype)).add_(_ADAM_EPS)
    p.copy_(torch.where(on, p.addcmul(exp_avg / denom, -step_size), p))


# -- the round ----------------------------------------------------------------------------------------


class _Buffers:
    """One step's slice of the plan, at fixed addresses (what a captured graph reads): typed views of
    one row of the plan's bytes, so that `load` is one copy (two with `inputs`)."""

    def __init__(self, plan: _Plan) -> None:
        self.bytes = plan.row(0).clone()
        views = plan.chunks[0].views(self.bytes)
        self.rows, self.weight = views["rows"], views["weight"]
        self.divisor, self.share, self.count64, self.active = (
            views["divisor"], views["share"], views["count64"], views["active"]
        )  # fmt: skip
        """The count clamped to 1 (the mean's divisor), the weight over it, the count in float64 (the
        losses' sum), 1 where the node has a batch."""
        self.draws = [views[f"draw{j}"] for j in range(sum(name.startswith("draw") for name in views))]
        self.step_inputs = {name.removeprefix("step."): t for name, t in views.items() if name.startswith("step.")}
        self.inputs = plan.inputs[0].clone() if plan.inputs is not None else None
        self.batch, self.labels = views.get(BATCH_ROOM), views.get(LABELS_ROOM)
        """(K, B, ...) the step's augmented batch and (K, B) its labels, where the round makes them ahead
        (`_fill_outputs`)."""

    def load(self, plan: _Plan, s: int) -> None:
        """Step `s`'s slice of the plan into the buffers (device to device, no host sync; its chunk drawn
        first where it is not yet: `_Plan.row`)."""
        self.bytes.copy_(plan.row(s))
        if self.inputs is not None and plan.inputs is not None:
            self.inputs.copy_(plan.inputs[s])


def _rows_of(parts: Sequence[torch.Tensor], device: torch.device, capacity: int) -> torch.Tensor:
    """The nodes' rows concatenated on `device`, in a buffer of at least `capacity` rows (a kept round's:
    a later call with more rows than the first fills the same buffer)."""
    rows = torch.cat([t.to(device) for t in parts])
    if capacity <= len(rows):
        return rows
    buffer = rows.new_zeros((capacity, *rows.shape[1:]))
    buffer[: len(rows)] = rows
    return buffer


EpochStart = Callable[[int, dict[str, torch.Tensor], dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]
"""`train_vectorized`'s epoch_start: (node, its parameters now, its carried state now) -> its renewed
carried state (every carried tensor)."""


@dataclass(frozen=True)
class _EpochStarts:
    """Where nodes renew their carried state from their own parameters (`train_vectorized`'s epoch_start)."""

    at: dict[int, list[int]]
    """Step -> the stack positions whose epoch (not the first) starts there."""
    state: EpochStart
    """(stack position, the node's parameters now, its carried state now) -> its renewed carried state."""

    @classmethod
    def of(
        cls,
        renew: EpochStart,
        order: Sequence[int],
        ordered: Sequence[TensorDataset],
        settings: TrainSettings,
    ) -> _EpochStarts:
        at: dict[int, list[int]] = {}
        for pos, data in enumerate(ordered):
            per_epoch = steps_per_epoch(len(data), settings.batch_size, settings.drop_last)
            for epoch in range(1, settings.local_epochs if per_epoch else 0):
                at.setdefault(epoch * per_epoch, []).append(pos)
        return cls(at, lambda pos, params, carried: renew(order[pos], params, carried))


class _Round:
    """The K nodes' local training as S identical steps over static buffers: each step copies its slice
    of the plan into the buffers (device to device) and runs, eagerly or as one replay of a CUDA graph
    captured from the first steps; losses accumulate on the device."""

    def __init__(
        self,
        model: nn.Module,
        datasets: Sequence[TensorDataset],
        settings: TrainSettings,
        plan: _Plan,
        steps: Sequence[BatchTransform] | None,
        objective: GroupObjective,
        inputs: dict[str, torch.Tensor],
        device: torch.device,
        starts: Sequence[Mapping[str, torch.Tensor]] | None = None,
        carry: dict[str, torch.Tensor] | None = None,
        sum_gradients: bool = False,
        epoch_starts: _EpochStarts | None = None,
        capacity: int = 0,
        outputs: Mapping[str, BatchOutput] | None = None,
    ) -> None:
        self.settings, self.plan, self.steps = settings, plan, steps
        self.outputs = dict(outputs or {})
        """The objective's `BatchOutput`s: made for each chunk of the plan (`_fill_outputs`) where the plan
        has room for them (`OUTPUTS_AHEAD`), else inside each step on its batch."""
        self.ahead = bool(self.outputs) and all(f"step.{name}" in plan.layout for name in self.outputs)
        inline = {} if self.ahead else self.outputs
        self.batch_ahead = BATCH_ROOM in plan.layout
        """Whether each step's augmented batch is made for a chunk of the plan before its steps run."""
        self.epoch_starts = epoch_starts
        k = len(datasets)
        self.stack = _Stack.of(model, k, settings, device, starts)
        self.lr = _LearningRate.of(settings.lr, next(model.parameters()).dtype, device)
        self.frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        self.start = {n: p.detach().to(device).clone() for n, p in model.named_parameters() if p.requires_grad}
        self.x = _rows_of([d.x for d in datasets], device, capacity) if plan.inputs is None else None
        self.y = _rows_of([d.y for d in datasets], device, capacity)
        self.inputs = inputs
        self.constants = _constants(steps or [], device, _image_size(datasets[0].x))
        self.buffers = _stacked_buffers(model, k, device)
        """(K, ...) each node's buffers (BatchNorm's running statistics), updated after each of its steps."""
        frozen = self.frozen
        norm_step = self.norm_step = NormStep()
        # BatchNorm over each node's real samples, GroupNorm as one over the nodes; the model itself when it has neither
        net = over_nodes(masked_norms(model, norm_step))
        norms = self.norms = has_batch_norm(model)
        """Whether the model holds a BatchNorm: then a step's kind says whether its batches are whole."""

        def forward(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(net, {**params, **frozen}, (x,))

        start = self.start

        def node_loss(
            params: dict[str, torch.Tensor],
            x: torch.Tensor,
            y: torch.Tensor,
            weight: torch.Tensor,
            count: torch.Tensor,
            share: torch.Tensor,
            node_inputs: dict[str, torch.Tensor],
            step: dict[str, torch.Tensor],
            carried: dict[str, torch.Tensor],
            buffers: dict[str, torch.Tensor],
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            run = forward
            if norms:  # BatchNorm: over the node's real samples, with its own running statistics

                def run(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
                    return functional_call(net, {**params, **frozen, **buffers}, (x,))

            guard: contextlib.AbstractContextManager[dict[str, torch.Tensor]] = (
                norm_step.batch(weight) if norms else contextlib.nullcontext({})
            )
            if inline:  # the frozen functions of the batch, in the step
                with torch.no_grad():
                    step = {**step, **{name: made.of(x, node_inputs) for name, made in inline.items()}}
            with guard as statistics:  # each BatchNorm's batch statistics, blended in after the map
                out = objective(NodeBatch(run, params, start, x, y, weight, count, node_inputs, step, carried, share))
            if not isinstance(out, tuple):
                return out, {}, {}, statistics
            return (out[0], out[1], out[2] if len(out) == 3 else {}, statistics)

        vmapped = vmap(node_loss)

        def losses_of(*args: Any) -> Outputs:
            with autocast(settings, device):  # the forward pass only, as local_sgd's; the backward follows it
                return vmapped(*args)

        self.losses_of = losses_of
        self.cur = _Buffers(plan)
        """The static buffers every step reads."""
        plan.fill = self._fill_outputs if self.ahead or self.batch_ahead else None  # from the first `load` on
        self.totals = torch.zeros(k, dtype=torch.float64, device=device)
        self.seeds = _Seeds(k, device)
        self.terms: dict[str, torch.Tensor] = {}
        """Each named term of the objective, summed over each node's steps."""
        self.carry = carry or {}
        """(K, ...) each node's carried state, updated in place by its steps (a captured graph's buffers)."""
        self.gradient_sums = (
            {name: torch.zeros_like(p) for name, p in self.stack.params.items()} if sum_gradients else None
        )
        """Each node's gradients summed over its steps, before clipping (`sum_gradients`)."""

    def reset(
        self,
        model: nn.Module,
        datasets: Sequence[TensorDataset],
        plan: _Plan,
        starts: Sequence[Mapping[str, torch.Tensor]] | None,
        settings: TrainSettings,
        inputs: Mapping[str, torch.Tensor] | None = None,
        carry: Mapping[str, torch.Tensor] | None = None,
        epoch_starts: _EpochStarts | None = None,
    ) -> None:
        """Make this round another call's (`keep_rounds`: the same signature), in place: every tensor a
        captured step reads keeps its address, so the graphs captured for the first call replay this one.
        The new data fills the front of the data buffers, the new plan is what `load` copies from, the
        nodes' own inputs and carried state (stacked, in stack order) are copied over the first call's,
        this call's epoch starts (eager, between steps) replace the first's and its lr (`settings`, the
        signature's but for the lr) is set where the steps read it."""
        self.epoch_starts = epoch_starts  # the signature says there is one exactly when the round had one
        self.settings = settings
        self.lr.set(settings.lr)
        with torch.no_grad():
            for name, t in (inputs or {}).items():
                self.inputs[name].copy_(t)
            for name, t in (carry or {}).items():
                self.carry[name].copy_(t)
            fresh = _Stack.params_of(model, len(self.totals), self.totals.device, starts, views=True)
            torch._foreach_copy_(list(self.stack.params.values()), list(fresh.values()))
            for kept in self.stack.state.values():
                torch._foreach_zero_(kept)
            self.stack.step.zero_()
            for name, p in model.named_parameters():
                (self.frozen if name in self.frozen else self.start)[name].copy_(p.detach())
            for name, b in model.named_buffers():
                self.buffers[name].copy_(b.detach().unsqueeze(0).expand_as(self.buffers[name]))
            rows = sum(len(d) for d in datasets)
            if self.x is not None:  # concatenated in place: one pass over the nodes' data, not two
                torch.cat([d.x.to(self.x.device) for d in datasets], out=self.x[:rows])
            torch.cat([d.y.to(self.y.device) for d in datasets], out=self.y[:rows])
            for t in [self.totals, *self.terms.values(), *(self.gradient_sums or {}).values()]:
                t.zero_()
        plan.fill = self._fill_outputs if self.ahead or self.batch_ahead else None
        self.plan = plan

    @torch.no_grad()
    def _fill_outputs(self, lo: int, hi: int, chunk: Packed) -> None:
        """The augmented batches (`batch_ahead`) and the `BatchOutput`s (`ahead`) of steps lo to hi - 1 (a
        chunk of the plan) into their fields of its rows: the batches as `batch` makes them in a step, each
        function on them, a few steps at a time (`OUTPUT_ROWS`). Eager, before the chunk's first step loads
        its row: outside any graph."""
        rows = chunk.view(chunk.rows, "rows")
        draws = [chunk.view(chunk.rows, f"draw{j}") for j in range(len(self.cur.draws))]
        fields = {name: chunk.view(chunk.rows, f"step.{name}") for name in self.outputs} if self.ahead else {}
        batches = chunk.view(chunk.rows, BATCH_ROOM) if self.batch_ahead else None
        if self.batch_ahead:  # the steps' labels: one gather a chunk, not one a step
            labels = chunk.view(chunk.rows, LABELS_ROOM)
            labels.copy_(self.y[rows.reshape(-1)].view(labels.shape))
        limit = OUTPUT_ROWS if chunk.rows.device.type == "cuda" else CPU_OUTPUT_ROWS
        per = max(1, limit // max(1, rows[0].numel()))  # steps a call
        for a in range(0, hi - lo, per):
            b = min(a + per, hi - lo)
            if self.x is not None:
                x = self._augmented(rows[a:b], [d[a:b] for d in draws])
            else:
                assert self.plan.inputs is not None
                inputs = self.plan.inputs[lo + a : lo + b]
                x = inputs.reshape(-1, *inputs.shape[3:])
            # the standard strides (a view): a size-1 dimension's stride is free, and a CPU convolution picks
            # its algorithm by the strides (a 1-channel batch can look channels-last), so the same values
            # came out a bit apart from a kept round's buffer and a fresh one's (2026-11-29)
            x = x.reshape(-1).view(x.shape)
            if batches is not None:
                into_batch = batches[a:b]
                if x.dtype != into_batch.dtype or x.shape[1:] != into_batch.shape[3:]:
                    raise VectorizeError(
                        f"a step's batch is {x.dtype} {tuple(x.shape[1:])} a sample, its room in the plan"
                        f" {into_batch.dtype} {tuple(into_batch.shape[3:])}"
                    )
                into_batch.copy_(x.view(into_batch.shape))
            for name, out in self.outputs.items() if self.ahead else ():
                into = fields[name][a:b]  # (steps, K, B, *shape)
                if not out.per_node:
                    into.copy_(out.fn(x).view(into.shape))
                    continue
                # each node's samples of these steps as one batch, mapped over the nodes with their inputs
                steps, k, b_rows = into.shape[:3]
                by_node = (
                    x.view(steps, k, b_rows, *x.shape[1:]).transpose(0, 1).reshape(k, steps * b_rows, *x.shape[1:])
                )
                made = vmap(out.fn)(by_node, self.inputs)  # (K, steps * B, *shape)
                into.copy_(made.view(k, steps, b_rows, *out.shape).transpose(0, 1))

    @property
    def seen(self) -> torch.Tensor:
        """Each node's real samples over the round, known from the plan once its steps have run."""
        return self.plan.seen

    def load(self, s: int) -> None:
        """Step `s`'s slice of the plan into the buffers, and the carried state of each node whose epoch
        starts at `s` renewed from its current parameters (`epoch_start`; eager, before the step)."""
        self.cur.load(self.plan, s)
        if self.epoch_starts is None:
            return
        for pos in self.epoch_starts.at.get(s, ()):
            renewed = self.epoch_starts.state(
                pos,
                {name: t[pos] for name, t in self.stack.params.items()},
                {name: t[pos] for name, t in self.carry.items()},
            )
            if set(renewed) != set(self.carry):
                raise VectorizeError(f"epoch_start gave {sorted(renewed)}, not the carried {sorted(self.carry)}")
            for name, value in renewed.items():
                self.carry[name][pos].copy_(value)

    def batch(self, a: int) -> tuple[torch.Tensor, torch.Tensor]:
        cur = self.cur
        if cur.batch is not None and cur.labels is not None:  # made for the chunk before its steps (`batch_ahead`)
            return cur.batch[:a], cur.labels[:a]
        rows = cur.rows[:a]
        y = self.y[rows.reshape(-1)].view(rows.shape)
        if cur.inputs is not None:
            return cur.inputs[:a], y
        x = self._augmented(rows, [d[:a] for d in cur.draws])
        return x.view(*rows.shape, *x.shape[1:]), y

    def _augmented(self, rows: torch.Tensor, draws: Sequence[torch.Tensor]) -> torch.Tensor:
        """The data's `rows` (any shape) transformed with their drawn values, as one flat batch."""
        assert self.x is not None  # the plan holds the inputs exactly when the data is not kept
        x = self.x[rows.reshape(-1)]
        return _apply_steps(x, self.steps, [d.reshape(-1) for d in draws], self.constants) if self.steps else x

    def step(self, a: int, masked: bool = False, whole: bool = False) -> None:
        """One optimizer step of the first `a` nodes. Nodes are sorted by their steps, so the first
        `a` all train when `a` is the step's active count (an eager step); a captured step takes the first
        b (`step_kind`), `masked` where some of them have no batch left: those keep their weights, optimizer
        state and carried state, restored after the update so that the others' arithmetic is the unmasked
        step's. `whole`: every node that trains has a whole batch, so a BatchNorm needs no masking
        (`fedcore.masked_norm`)."""
        self.norm_step.whole, self.norm_step.everyone = whole, not masked
        x, y = self.batch(a)
        cur = self.cur
        active = cur.active[:a]
        params, state, steps = self.stack.head(a)
        inputs = {n: t[:a] for n, t in self.inputs.items()}
        step_inputs = {n: t[:a] for n, t in cur.step_inputs.items()}
        carried = {n: t[:a] for n, t in self.carry.items()}
        buffers = {n: t[:a] for n, t in self.buffers.items()}
        grads, losses, terms, after, statistics = _gradients(
            self.losses_of, params, x, y, cur.weight[:a], cur.divisor[:a], cur.share[:a], inputs, step_inputs, carried,
            buffers, seeds=self.seeds,
        )  # fmt: skip
        settings = self.settings
        with torch.no_grad():
            if self.gradient_sums is not None:
                sums = [self.gradient_sums[name][:a] for name in grads]
                torch._foreach_add_(sums, _masked(list(grads.values()), active, masked))
            if settings.max_grad_norm is not None:
                _clip(grads, settings.max_grad_norm)
            # a parameter the objective leaves unused (FedNH's classifier) has no gradient: skipped, as torch's
            # optimisers skip it
            names = [name for name in params if name in grads]
            if settings.optimizer == "adam":
                steps.add_(active)
                for name in names:
                    _adam(params[name], grads[name], state[name], active, steps, settings, self.lr)
            else:
                tensors = [params[n] for n in names] + [t for n in names for t in state[n]]
                kept = torch._foreach_mul(tensors, 1.0) if masked else []
                _sgd_all(
                    [params[n] for n in names],
                    [grads[n] for n in names],
                    [state[n][0] for n in names if state[n]],
                    settings,
                    self.lr,
                )
                for t, old in zip(tensors, kept, strict=masked):  # nodes with no batch left keep what they had
                    t.copy_(torch.where(_per_node(active, t) > 0, t, old))
            self.totals[:a].addcmul_(losses, cur.count64[:a])  # in float64, one kernel
            for name, value in terms.items():
                if name not in self.terms:  # created by the first (eager) step, before any graph is captured
                    self.terms[name] = torch.zeros((len(self.totals), *value.shape[1:]), dtype=torch.float64,
                                                   device=self.totals.device)  # fmt: skip
                self.terms[name][:a].add_(_masked([value], active, masked)[0])  # in place: no copy back
            if set(after) != set(carried):
                raise VectorizeError(
                    f"the objective carried {sorted(after)}, not the state it was given {sorted(carried)}"
                )
            if after and not masked:  # every node trained: one multi-tensor copy
                torch._foreach_copy_(
                    [carried[name] for name in after], [v.to(carried[n].dtype) for n, v in after.items()]
                )
            for name, value in after.items() if masked else ():  # a node with no batch left keeps its own
                value = value.to(carried[name].dtype)
                carried[name].copy_(torch.where(_per_node(active, value) > 0, value, carried[name]))
            update_running_statistics(self.norm_step, buffers, statistics, active, masked)


def _masked(tensors: list[torch.Tensor], active: torch.Tensor, masked: bool) -> list[torch.Tensor]:
    """Each (K, ...) tensor with the rows of inactive nodes zeroed, when the step is `masked` (filled, not
    multiplied: an inactive node's all-padding batch must not spill a NaN into its sums)."""
    return [t.masked_fill(_per_node(active, t) == 0, 0) for t in tensors] if masked else tensors


WARMUP_STEPS = 3
"""Eager steps before a CUDA graph is captured (on a side stream, as torch.cuda.graphs asks), which
are real steps of the round."""


def step_kind(active: int, k: int) -> tuple[int, bool]:
    """The captured step that trains a step's `active` nodes of K (a prefix: nodes are sorted by their
    steps): the step over the first b nodes, b the smallest power of two at or above `active` (K at
    most), masked where b > active. So a round captures at most 2 (log2 K + 1) graphs, and a step's
    work follows the nodes still training: with shards of unequal sizes (a Dirichlet split) a step over
    all K would spend most of a round on nodes with no batch left (KDIA's CIFAR-10 split at beta 0.1,
    10 of its 100 shards drawn 2,000 times: on average 42% of K times the longest node's steps are the
    nodes' own)."""
    if not 0 < active <= k:
        raise ValueError(f"a step trains 1 to {k} nodes, not {active}")
    b = min(k, 1 << (active - 1).bit_length())
    return b, b > active


def _run(
    round_: _Round,
    active: Sequence[int],
    graphs: bool,
    captured: dict[Hashable, torch.cuda.CUDAGraph] | None = None,
    whole: Sequence[bool] | None = None,
) -> None:
    """All steps; `active[s]` nodes (a prefix: nodes are sorted by their steps) train at step s. Captured,
    a step is its kind's graph (`step_kind`: the first b nodes, masked where some of them have no batch
    left), kept in `captured` for the round's next call; eager, it takes the `active[s]` nodes. `whole`
    (a BatchNorm model's round): whether each step's batches are all whole (`whole_batch_steps`), a third
    part of its kind; without it every step is taken as padded, which the masked statistics handle too."""
    k = len(round_.totals)

    def kind(s: int) -> tuple[int, bool] | tuple[int, bool, bool]:
        return step_kind(active[s], k) if whole is None else (*step_kind(active[s], k), whole[s])

    run_steps(
        len(active),
        round_.load,
        lambda s: round_.step(active[s], whole=whole is not None and whole[s]),
        lambda kind: round_.step(*cast(tuple[int, bool, bool], kind)),
        graphs,
        kind=kind,
        captured=captured,
    )


def run_steps(
    total: int,
    load: Callable[[int], None],
    eager: Callable[[int], None],
    whole: Callable[[Hashable], None],
    graphs: bool,
    kind: Callable[[int], Hashable] = lambda s: None,
    captured: dict[Hashable, torch.cuda.CUDAGraph] | None = None,
) -> None:
    """`total` steps over static buffers, `load(s)` copying step s's inputs into them first: each run by
    `eager(s)`, or with `graphs` (a CUDA device) by `whole(kind(s))`, the steps of each kind one
    computation every step of that kind can be. A kind with more than `WARMUP_STEPS` + 1 steps runs its
    first `WARMUP_STEPS` on a side stream, is then captured once as a CUDA graph (recorded, not run) and
    replayed for each of its steps left, as the torch.cuda.graphs whole-network example does; the steps
    of a kind too rare to capture run by `eager(s)`. `captured`: graphs captured by an earlier call over
    the same buffers, replayed from the first step (and the graphs this call captures are added to it)."""
    if not graphs or (total <= WARMUP_STEPS + 1 and not captured):
        for s in range(total):
            load(s)
            eager(s)
        return
    kinds = [kind(s) for s in range(total)]
    counts = Counter(kinds)
    warmed: Counter[Hashable] = Counter()
    captured = {} if captured is None else captured
    side = torch.cuda.Stream()
    for s, k in enumerate(kinds):
        load(s)
        if k in captured:
            captured[k].replay()
        elif counts[k] <= WARMUP_STEPS + 1:
            eager(s)
        elif warmed[k] < WARMUP_STEPS:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                whole(k)
            torch.cuda.current_stream().wait_stream(side)
            warmed[k] += 1
        else:
            graph = torch.cuda.CUDAGraph()
            # captured on this call's side stream, not torch's one capture stream for the process, and
            # guarding this thread's calls only: cells simulated as threads of one process capture their
            # own graphs at the same time (experiments.simulate_grid's cells_per_process)
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                whole(k)  # recorded, not run
            graph.replay()
            captured[k] = graph


@dataclass
class _Kept:
    """A round kept after its call, with the graphs captured over its buffers (`keep_rounds`)."""

    round: _Round
    graphs: dict[Hashable, torch.cuda.CUDAGraph]
    capacity: int
    """Rows its data buffers hold: a call with more builds a new round."""
    model: nn.Module
    transform: object
    """Held so that the ids in the signature stay theirs."""


KEPT: ContextVar[dict[Hashable, _Kept] | None] = ContextVar("fedmq_vectorized_kept", default=None)
"""The rounds `train_vectorized` keeps for the next call with the same signature, inside `keep_rounds`."""

KEPT_COUNTS: ContextVar[Counter[str] | None] = ContextVar("fedmq_vectorized_kept_counts", default=None)
"""What became of each vectorised call inside `keep_rounds`, counted (`keep_rounds` yields the counter)."""


@contextmanager
def keep_rounds() -> Iterator[Counter[str]]:
    """Inside the block, a `train_vectorized` call on the default objective (FedAvg's training) and a
    model with no tensor outside its parameters and buffers, or a call with a key (`keep_as`: KDIA's,
    FedACD's, FedNH's, the loss terms'), keeps its round, and a later call with the
    same signature (the same model object, device, number of nodes, settings, transform, objective
    key) and no more rows of data trains in it: its buffers refilled
    in place, so that on a CUDA device the graphs captured by the first call replay every later one,
    with no warm-up steps and no capture. Results are bitwise those of a fresh round. At most
    `KEPT_ROUNDS` are kept; rounds and graphs are freed when the block ends. Yields the count of the
    block's calls by what became of them: "reused" (trained in a kept round), "built" (a round built and
    kept), "not kept" (a call with neither FedAvg's objective nor a key, or its model's loose tensors
    without a key): a run whose calls keep being "built" has something in their signature that changes
    from call to call, and gains nothing from keeping them."""
    counts: Counter[str] = Counter()
    token, counting = KEPT.set({}), KEPT_COUNTS.set(counts)
    try:
        yield counts
    finally:
        KEPT.reset(token)
        KEPT_COUNTS.reset(counting)


KEPT_ROUNDS = 4
"""Rounds kept at most (the oldest dropped first): one per shape a simulation's groups take."""


def _signature(
    model: nn.Module,
    k: int,
    settings: TrainSettings,
    transform: object,
    sum_gradients: bool,
    plain: bool,
    objective: Hashable = None,
) -> Hashable:
    """What a kept round was built for: the model object itself (the forward pass and a captured graph
    read its tensors), its parameters' shapes, the number of nodes, the settings but for the lr (the
    optimizer's other constants are in the graph; the lr is read from the device, `_LearningRate`), the
    transform (its constants too) and the objective's key (`keep_as`; None: FedAvg's)."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters())
    first = next(model.parameters())
    constants = replace(settings, lr=1.0)  # a decayed lr, another of FedRCL's epochs: the same round
    return (id(model), params, first.device, k, constants, id(transform), sum_gradients, plain, objective)


def _kept_round(
    model: nn.Module,
    ordered: Sequence[TensorDataset],
    settings: TrainSettings,
    plan: _Plan,
    starts: Sequence[Mapping[str, torch.Tensor]] | None,
    transform: object,
    sum_gradients: bool,
    known: Sequence[BatchTransform] | None,
    objective: GroupObjective = cross_entropy_objective,
    objective_key: Hashable = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
    carry: Mapping[str, torch.Tensor] | None = None,
    epoch_starts: _EpochStarts | None = None,
    outputs: Mapping[str, BatchOutput] | None = None,
) -> _Kept | None:
    """Inside `keep_rounds`, the kept round for this call, reset to it, or a new one kept (the oldest
    dropped beyond `KEPT_ROUNDS`); None outside it, or for a model holding loose tensors unless the call
    has a key (which then holds their addresses: FedNH's prototypes, loaded in place). A kept round
    trains with the objective of the call that built it (`objective_key` says it is this call's)."""
    kept_rounds = KEPT.get()
    if kept_rounds is None:
        return None
    if objective_key is None and _holds_loose_tensors(model):
        _count("not kept")
        return None
    rows = sum(len(d) for d in ordered)
    # what the round's buffers are laid out for: a call that differs gets a round of its own, so that a
    # kept round's copies (`reset`) and its buffers' typed views always fit what they are given
    shapes = tuple((n, tuple(t.shape), t.dtype) for n, t in {**(inputs or {}), **(carry or {})}.items())
    layout = (tuple(plan.layout.items()), shapes, epoch_starts is not None)
    key = _signature(
        model, len(ordered), settings, transform, sum_gradients, known is not None, (objective_key, layout)
    )
    kept = kept_rounds.get(key)
    if kept is not None and rows <= kept.capacity:
        kept.round.reset(model, ordered, plan, starts, settings, inputs, carry, epoch_starts)
        _count("reused")
        return kept
    _count("built")
    capacity = rows * 5 // 4  # room for later, larger groups
    device = next(model.parameters()).device
    own_inputs = {name: t.clone() for name, t in (inputs or {}).items()}  # the round's: refilled by later calls
    own_carry = {name: t.clone() for name, t in (carry or {}).items()}
    round_ = _Round(
        model, ordered, settings, plan, known, objective, own_inputs, device, starts, own_carry, sum_gradients,
        epoch_starts, capacity=capacity, outputs=outputs,
    )  # fmt: skip
    kept_rounds.pop(key, None)
    while len(kept_rounds) >= KEPT_ROUNDS:
        kept_rounds.pop(next(iter(kept_rounds)))
    kept = kept_rounds[key] = _Kept(round_, {}, capacity, model, transform)
    return kept


def _count(outcome: str) -> None:
    """One call's outcome in `keep_rounds`' counter (none outside it)."""
    counts = KEPT_COUNTS.get()
    if counts is not None:
        counts[outcome] += 1


def _holds_loose_tensors(model: nn.Module) -> bool:
    """Whether a module keeps a tensor outside its parameters and buffers (FedNH's trainable wrapper holds
    its round's prototypes so): a kept round would go on reading the first round's."""
    return any(isinstance(v, torch.Tensor) for m in model.modules() for v in vars(m).values())


GRAPHS: ContextVar[str] = ContextVar("fedmq_vectorized_graphs", default="auto")
"""The CUDA graph mode of `train_vectorized` calls that do not give one (`graph_mode`): a simulation sets
it for the method's `train_group`, which does not pass it through."""


def graph_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    """Run the block with `train_vectorized`'s default `graphs` set to `mode` (auto, on, off)."""
    return holding(GRAPHS, mode)


def vectorizes_by_default(device_type: str) -> bool:
    """`simulation.vectorize: auto`'s rule: vectorised on a CUDA device, one by one on a CPU (where a
    round's nodes one after another train at least as fast: `fedmq bench sim`)."""
    return device_type == "cuda"


def use_graphs(device: torch.device, mode: str = "auto") -> bool:
    """Whether to capture the step as a CUDA graph: `mode` "on" or "off", or "auto" (on a CUDA device)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"graphs must be auto, on or off, not {mode!r}")
    return device.type == "cuda" and mode != "off"


PHASES = (
    "fedmq.vectorized.plan",
    "fedmq.vectorized.build",
    "fedmq.vectorized.steps",
    "fedmq.vectorized.sync",
    "fedmq.vectorized.results",
)
"""torch.profiler's marks around a call's phases on the host: its plan (on a GPU, its first chunk), the
round built or a kept one reset, the steps launched (and later chunks drawn), the wait for the last
step with the sums copied back, each node's results (`fedmq.experiments.bench.sim_profile` reads them)."""


def train_vectorized(
    model: nn.Module,
    datasets: Sequence[TensorDataset],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    *,
    objective: GroupObjective = cross_entropy_objective,
    inputs: Mapping[str, torch.Tensor] | None = None,
    draws: StepDraws | None = None,
    graphs: str | None = None,
    starts: Sequence[Mapping[str, torch.Tensor]] | None = None,
    carry: Mapping[str, torch.Tensor] | None = None,
    sum_gradients: bool = False,
    epoch_start: EpochStart | None = None,
    keep_as: Hashable | None = None,
    outputs: Mapping[str, BatchOutput] | None = None,
) -> list[tuple[StateDict, TrainStats]]:
    """Train one copy of `model` per dataset, each as `local_sgd(copy, data, settings, generator)` would
    on `objective` (within float tolerance), as one vectorised computation; `model` is left unchanged.

    Every draw of the round (each epoch's permutation, each batch's augmentation) is made before the
    steps that read it, node by node from its own generator in `local_sgd`'s order (on a CUDA device in
    chunks drawn while the device trains the steps before: `PIPELINE`); the steps run on the device
    with no host synchronisation, and on a CUDA device as replays of one captured graph (`graphs`: auto,
    on, off; default: `graph_mode`'s). `inputs` holds each node's own tensors for the objective, stacked
    along dimension 0; `draws`, what the objective draws from the node's generator besides the batches;
    `starts`, each node's own trainable parameters to start from instead of `model`'s (a method that
    trains in several calls, FedRCL epoch by epoch); `NodeBatch.start` is `model`'s either way;
    `carry`, each node's state at its first step, stacked along dimension 0 as `inputs` are, which the
    objective reads (`NodeBatch.carry`) and returns updated after each of the node's steps (a state a
    method's own training keeps across its steps: FedACD's running P). A node keeps its state through
    the steps it does not take; its last state is in its `TrainStats.carry`. `sum_gradients`: each
    node's gradients of the objective summed over its steps, before clipping (`TrainStats.gradient_sums`).
    `epoch_start(k, params, carried)`: node k's carried state renewed from its parameters and carried
    state as they are before the first step of each of its epochs but the first (a state a method's
    training recomputes every epoch: FedACD's P from a clean pass of the model, or from the rows its
    last epoch summed); run eagerly between steps, outside any graph, so that no step recomputes it.
    `keep_as`: for an objective of the method's own (and its `draws`), a key saying that it is the same
    computation as any other call's with the same key, so that inside `keep_rounds` the call may train
    in a round kept from such a call (whose objective, and on a GPU whose captured graphs, then run):
    the objective must read nothing but its `NodeBatch` and tensors that keep their addresses from call
    to call (updated in place: a spare model's parameters), and the key must hold every Python value
    it reads (hyperparameters, flags) and those tensors' addresses; its `inputs` and `carry` are copied
    into the kept round's, and its `epoch_start` replaces the kept round's. FedAvg's objective needs no key,
    unless `model` holds tensors outside its parameters and buffers (FedNH's prototypes), which are kept
    only under a key holding their addresses (loaded in place from call to call).
    `outputs`: functions of each step's batch that do not train (`BatchOutput`: a frozen teacher's), which
    the objective reads as `NodeBatch.step[name]`: on a CUDA device made for a chunk of steps at once
    before they run (`round_plan.OUTPUTS_AHEAD`), elsewhere inside each step on its batch (under the
    step's autocast; made ahead, they run in the model's own precision). A kept round makes those of the
    call that built it, as it runs its objective (`keep_as`).

    Returns per node, in the order given, its state dict (fresh tensors, not aliasing `model`) and
    its TrainStats. Raises VectorizeError for a model `unsupported` refuses.
    """
    reason = unsupported(model, batch_norm=objective is cross_entropy_objective)
    if reason is not None:
        raise VectorizeError(reason)
    if len(datasets) != len(generators) or not datasets:
        raise ValueError(f"{len(datasets)} datasets and {len(generators)} generators: one of each per node")
    if starts is not None and len(starts) != len(datasets):
        raise ValueError(f"{len(starts)} starting models for {len(datasets)} nodes")
    for what, given in (("inputs", inputs), ("carry", carry)):
        for name, t in (given or {}).items():
            if len(t) != len(datasets):
                raise ValueError(f"{what} {name!r} holds {len(t)} rows for {len(datasets)} nodes: one per node")
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    steps = [settings.local_epochs * steps_per_epoch(len(d), settings.batch_size, settings.drop_last) for d in datasets]
    order = sorted(range(len(datasets)), key=lambda k: -steps[k])  # stable: longest first, then as given
    ordered = [datasets[k] for k in order]
    transform = ordered[0].train_transform
    plain = all(type(d) is TensorDataset and d.train_transform is transform for d in ordered)
    known = (known_steps(transform) if transform is not None else []) if plain else None
    sizes = [len(d) for d in ordered]
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
    num_steps = max(steps)
    stacked = {name: t[torch.tensor(order, device=t.device)].to(device) for name, t in (inputs or {}).items()}
    carried = {name: t[torch.tensor(order, device=t.device)].to(device) for name, t in (carry or {}).items()}
    was_training = model.training
    model.train()
    kept: _Kept | None = None
    try:
        if num_steps > 0:
            gens = [generators[k] for k in order]
            with record_function(PHASES[0]):
                plan = _plan(
                    ordered,
                    settings,
                    gens,
                    known,
                    offsets,
                    num_steps,
                    dtype,
                    device,
                    draws,
                    pipelined=_pipelined(device),
                    outputs=outputs if _ahead(device) else None,
                    batch=_batch_room(ordered[0], device, num_steps * len(ordered) * settings.batch_size)
                    if known and _ahead(device)
                    else None,
                )
            own = [starts[k] for k in order] if starts is not None else None
            default = objective is cross_entropy_objective and not (
                draws or stacked or carried or epoch_start or outputs
            )
            key = keep_as  # FedAvg's objective needs none; with one, the key vouches for the model's loose tensors
            starts_at = _EpochStarts.of(epoch_start, order, ordered, settings) if epoch_start else None
            kept = None
            with record_function(PHASES[1]):
                if not (default or keep_as is not None):
                    _count("not kept")
                else:
                    kept = _kept_round(
                        model, ordered, settings, plan, own, transform, sum_gradients, known, objective, key, stacked,
                        carried, starts_at, outputs,
                    )  # fmt: skip
                if kept is not None:
                    round_ = kept.round
                else:
                    round_ = _Round(
                        model, ordered, settings, plan, known, objective, stacked, device, own, carried, sum_gradients,
                        starts_at, outputs=outputs,
                    )  # fmt: skip
            active = [sum(1 for k in order if steps[k] > s) for s in range(num_steps)]
            torch_norm = round_.norms and TORCH_AT_WHOLE_BATCHES.get()
            whole = whole_batch_steps(sizes, settings, num_steps) if torch_norm else None
            with record_function(PHASES[2]):
                graphed = use_graphs(device, graphs or GRAPHS.get())
                _run(round_, active, graphed, kept.graphs if kept else None, whole)
            with record_function(PHASES[3]):  # the first copy back waits for the last step
                stack, frozen, totals, seen = round_.stack, round_.frozen, round_.totals.cpu(), round_.seen
                buffers = round_.buffers
                terms = {name: t.cpu() for name, t in round_.terms.items()}
                carried = {name: t.cpu() for name, t in round_.carry.items()}
                gradients = {name: t.cpu() for name, t in (round_.gradient_sums or {}).items()}
        else:
            terms, carried = {}, {name: t.cpu() for name, t in carried.items()}
            stack = _Stack.of(model, len(order), settings, device, [starts[k] for k in order] if starts else None)
            gradients = {name: torch.zeros_like(t).cpu() for name, t in stack.params.items()} if sum_gradients else {}
            frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
            buffers = _stacked_buffers(model, len(order), device)
            totals = seen = torch.zeros(len(order), dtype=torch.float64)
    finally:
        model.train(was_training)
    with record_function(PHASES[4]):
        return _results(
            model, stack, frozen, buffers, order, steps, totals, seen, terms, carried, gradients,
            kept=KEPT.get() is not None,
        )  # fmt: skip


def _results(
    model: nn.Module,
    stack: _Stack,
    frozen: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    order: list[int],
    steps: list[int],
    totals: torch.Tensor,
    seen: torch.Tensor,
    terms: Mapping[str, torch.Tensor],
    carried: Mapping[str, torch.Tensor],
    gradients: Mapping[str, torch.Tensor],
    kept: bool = False,
) -> list[tuple[StateDict, TrainStats]]:
    """Each node's state dict (keys in `model.state_dict()` order) and stats, back in the caller's order;
    `kept`: the stack is a kept round's, which the next call overwrites, so the weights are copied out."""
    keys = list(model.state_dict())
    scalars = {name: t for name, t in terms.items() if t.dim() == 1}  # (K,): a mean over the steps
    tensors = {name: t for name, t in terms.items() if t.dim() > 1}  # (K, ...): a sum over the steps
    by_node: dict[int, tuple[StateDict, TrainStats]] = {}
    # a kept round's stack is copied whole, a tensor per parameter (not one per node and parameter: on a GPU
    # each copy is a kernel), and each node's weights are its rows of the copy; the frozen ones too
    params = {name: t.clone() for name, t in {**stack.params, **buffers}.items()} if kept else stack.params | buffers
    frozen = {name: t.clone() for name, t in frozen.items()} if kept else frozen
    # each node's rows taken at once (one call a tensor, not one a node and tensor: 1,000 calls for 100 nodes
    # of a 10-tensor model), and the host's numbers read as Python floats at once
    rows = {name: t.unbind(0) for name, t in params.items()}
    seen_n, total = seen.tolist(), totals.tolist()
    means = {name: t.tolist() for name, t in scalars.items()}
    for pos, k in enumerate(order):
        state = {name: rows[name][pos] if name in rows else frozen[name] for name in keys}
        n = seen_n[pos]
        own = {name: v[pos] / steps[k] for name, v in means.items()} if steps[k] else {}
        stats = TrainStats(
            loss=total[pos] / max(n, 1),
            steps=steps[k],
            samples_seen=int(n),
            terms=own,
            sums={name: t[pos].clone() for name, t in tensors.items()},  # each its own storage, as saved alone
            carry={name: t[pos].clone() for name, t in carried.items()},
            gradient_sums={name: t[pos].clone() for name, t in gradients.items()},
        )
        by_node[k] = (state, stats)
    return [by_node[k] for k in range(len(order))]
