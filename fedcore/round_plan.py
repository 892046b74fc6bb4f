"""A vectorised round's plan: every draw of the round, made before the steps that read it.

`train_vectorized` trains K nodes as S identical steps over static buffers, so every node's batches
(its epochs' permutations), its augmentation's random values and its objective's own draws (KDIA's
noise) are made on the host, node by node from its own generator in the order its own training
(`local_sgd`) draws them, and packed a step to a row of bytes (`fedcore.packed`) that a step loads
with one copy. On a GPU the plan is made in chunks as the steps need them (`PIPELINE`), so that the
host draws a chunk while the device trains the steps before it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.packed import Field, Packed, send
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.transforms import BatchTransform, RandomCrop, RandomHorizontalFlip, RandomRotation, _draw


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches `local_sgd` trains on per epoch: it stops at a batch of one sample unless n == 1 (so a
    trailing one is skipped, and with `batch_size` 1 every one), and with `drop_last` at any trailing
    batch short of `batch_size`."""
    if batch_size == 1 and n > 1:
        return 0
    full, rest = divmod(n, batch_size)
    if drop_last:
        return full
    return full + (1 if rest > 1 or (rest == 1 and n == 1) else 0)


def whole_batch_steps(sizes: Sequence[int], settings: TrainSettings, total: int) -> list[bool]:
    """For each of `total` steps, whether every node that trains at it has a whole batch of `batch_size`
    samples, none padded. Known from the shard sizes alone, on the host: of a node's epoch only the
    trailing batch can be short (`steps_per_epoch`), and with `batch_size` 1 no step is called whole (a
    batch of one sample, which torch's BatchNorm1d refuses, is left to the masked statistics)."""
    whole = [settings.batch_size > 1] * total
    for n in sizes:
        per = steps_per_epoch(n, settings.batch_size, settings.drop_last)
        if per > n // settings.batch_size:  # the epoch's last batch is short: steps per - 1, 2 per - 1, ...
            for s in range(per - 1, min(total, settings.local_epochs * per), per):
                whole[s] = False
    return whole


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


class StepDraws(Protocol):
    """Random values a method's objective draws from the node's generator, besides the batches: once
    before training (`first`) and with each batch, after its augmentation (`step`). They are drawn into
    the plan in that order, so they are the values the node's own training draws."""

    def first(self, data: TensorDataset, settings: TrainSettings, generator: torch.Generator) -> object:
        """What the node draws before its first batch (KDIA: the labels of its generated features)."""

    def step(self, state: object, s: int, rows: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """What step `s` draws for its batch of `rows` samples: tensors of `rows` rows (KDIA: noise, labels)."""

    def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On the device, every step at once, (S, K, B, ...): what the steps read (KDIA: the features)."""


@dataclass(frozen=True)
class BatchOutput:
    """A function of each step's batch that does not train (a frozen teacher's log-probabilities), which
    the objective reads as `NodeBatch.step[name]` instead of computing it at every step: made for a chunk
    of steps at once, on their batches augmented as the steps augment them, before any of them runs
    (`train_vectorized`'s `outputs`). A step then dispatches none of its operators, and the function runs
    on large batches, a few times a round. A function of each node's own frozen model (MOON's previous
    models) is `per_node`: it takes the node's `inputs` too, and the round maps it over the nodes."""

    fn: Callable[..., torch.Tensor]
    """(N, *input) -> (N, *shape): the inputs of N samples, as a step's batch holds them; `per_node`, with a
    second argument, one node's inputs (`GroupTerm.inputs`' rows), and N samples of that node."""
    shape: tuple[int, ...]
    """One sample's output."""
    dtype: torch.dtype = torch.float32
    per_node: bool = False
    """Whether `fn` reads the node's inputs: a model of each node's own, not one every node shares."""

    def of(self, x: torch.Tensor, node_inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The output on one node's samples `x`, whose own inputs are `node_inputs` (in a step, under vmap)."""
        return self.fn(x, node_inputs) if self.per_node else self.fn(x)


@dataclass
class _Plan:
    """K nodes' batches for all S steps, drawn node by node in `local_sgd`'s order (the epoch's
    permutation, then each batch's augmentation) and padded to the static shape (K, B) a step, so that
    the steps themselves read nothing from the host. A step's tensors (the batch's rows, their weights,
    the counts, the augmentation's values, the objective's drawn inputs) lie in one row of bytes
    (`fedcore.packed`), so that a step loads them all with one copy; the rows of steps are made in
    chunks (`chunks`, steps `bounds[i]` to `bounds[i + 1]`), the first at once and, where `draw` is
    given, each later one when a step first needs it (`row`): on a GPU the host draws a chunk while the
    device trains the steps before it (`_chunk_bounds`)."""

    chunks: list[Packed]
    bounds: list[int]
    """Chunk i holds steps bounds[i] to bounds[i + 1] - 1; the last bound is S."""
    inputs: torch.Tensor | None
    """(S, K, B, ...) the transformed inputs, for a transform the step does not know how to apply."""
    seen: torch.Tensor
    """(K,) float64 on the host: each node's real samples over the round (complete once every chunk is)."""
    draw: Callable[[int, int], Packed] | None = None
    """Makes the chunk of steps [lo, hi) (adding its samples to `seen`); None: every chunk is made."""
    fill: Callable[[int, int, Packed], None] | None = None
    """Fills the `BatchOutput` fields of the chunk of steps [lo, hi) (the round that trains the plan:
    it holds the data), before a step reads it; chunks are filled in order."""
    filled: int = 0
    """How many chunks `fill` has filled."""

    @property
    def layout(self) -> dict[str, Field]:
        """Where each tensor lies in a step's row of bytes (the same in every chunk)."""
        return self.chunks[0].layout

    def row(self, s: int) -> torch.Tensor:
        """Step `s`'s row of bytes, on the device; its chunk made first where it is not yet."""
        while s >= self.bounds[len(self.chunks)]:
            assert self.draw is not None, f"step {s} of a plan of {self.bounds[-1]}"
            lo, hi = self.bounds[len(self.chunks)], self.bounds[len(self.chunks) + 1]
            self.chunks.append(self.draw(lo, hi))
        i = bisect.bisect_right(self.bounds, s) - 1
        while self.fill is not None and self.filled <= i:
            self.fill(self.bounds[self.filled], self.bounds[self.filled + 1], self.chunks[self.filled])
            self.filled += 1
        return self.chunks[i].rows[s - self.bounds[i]]

    def field(self, name: str) -> torch.Tensor:
        """(S, ...) one tensor of every step (each chunk made first): what tests compare plans by."""
        self.row(self.bounds[-1] - 1)
        return torch.cat([chunk.view(chunk.rows, name) for chunk in self.chunks])


def _packed_steps(
    rows: torch.Tensor,
    weight: torch.Tensor,
    count: torch.Tensor,
    draws: Sequence[torch.Tensor],
    step_inputs: Mapping[str, torch.Tensor],
    device: torch.device,
    pinned: bool = False,
    room: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> Packed:
    """Steps' tensors packed on `device` with what a step derives from the counts once for all its
    steps: the mean's divisor, each sample's share of the mean, the counts in float64 and which nodes
    train (`_Buffers`). `pinned`: sent from page-locked memory without waiting (a chunk drawn while
    the GPU trains the steps before it: a plain copy would wait for them)."""
    divisor = count.clamp(min=1)  # a node with no batch left: its all-padding loss stays 0, not NaN
    tensors = {
        "rows": rows,
        "weight": weight,
        "count": count,
        **{f"draw{j}": d for j, d in enumerate(draws)},
        **{f"step.{n}": t for n, t in step_inputs.items()},
        "divisor": divisor,
        "share": weight / divisor.unsqueeze(-1),
        "count64": count.double(),
        "active": (count > 0).to(count.dtype),
    }
    return Packed.of(tensors, device, pinned=pinned, room=room)  # the room filled on the device (`_Plan.fill`)


FIRST_CHUNK = 2
"""Steps in a pipelined plan's first chunk (`_chunk_bounds`): what the device waits for before it starts."""


def _chunk_bounds(num_steps: int, pipelined: bool) -> list[int]:
    """Where a plan's chunks start: one chunk, or (`pipelined`) a first of `FIRST_CHUNK` steps and each
    later one twice the one before, so that the host draws each while the device trains the one before
    (the host draws a step in a fraction of the time a GPU trains it; the first chunk is all it waits for)."""
    if num_steps == 0:
        return [0, 0]
    bounds, size = [0], FIRST_CHUNK if pipelined else num_steps
    while bounds[-1] < num_steps:
        bounds.append(min(num_steps, bounds[-1] + size))
        size *= 2
    return bounds


PIPELINE: ContextVar[str] = ContextVar("fedmq_vectorized_pipeline", default="auto")
"""Whether `train_vectorized` draws its plan in chunks as the steps need them: auto (on a CUDA device,
where the host's drawing then overlaps the device's steps), on, off (one chunk drawn before any step).
On a CPU nothing overlaps, so auto leaves it off; tests set it on to hold it bitwise the one-chunk plan."""


@contextmanager
def holding(var: ContextVar[str], value: str) -> Iterator[None]:
    """Run the block with `var` set to `value`, and back to what it was after."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def plan_pipeline(mode: str) -> contextlib.AbstractContextManager[None]:
    """Run the block with `PIPELINE` set to `mode` (auto, on, off)."""
    return holding(PIPELINE, mode)


OUTPUTS_AHEAD: ContextVar[str] = ContextVar("fedmq_vectorized_outputs_ahead", default="auto")
"""Whether `train_vectorized` makes each step's augmented batch and its objective's `BatchOutput`s for a
chunk of steps before they run (room in the plan, `_Plan.fill`) or inside each step: auto (ahead on a CUDA
device, where a step is launch-bound and those kernels are then few and large), on, off. On a CPU the
step's own batch is faster (the batches made a second time for the function, and its larger calls, cost
more than they save: a MOON round of 2026-11-29 took 3.4 s ahead and 2.8 s in the step), so auto keeps
them there; tests set it on."""


def outputs_ahead(mode: str) -> contextlib.AbstractContextManager[None]:
    """Run the block with `OUTPUTS_AHEAD` set to `mode` (auto, on, off)."""
    return holding(OUTPUTS_AHEAD, mode)


def _ahead(device: torch.device) -> bool:
    mode = OUTPUTS_AHEAD.get()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"where batch outputs are made must be auto, on or off, not {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _pipelined(device: torch.device) -> bool:
    mode = PIPELINE.get()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"the plan's pipeline must be auto, on or off, not {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def _draws_of(ops: Sequence[_RandomOp], generator: torch.Generator, n: int) -> list[torch.Tensor]:
    """The random values a batch of `n` images takes from `generator` through the transform's random
    `ops`, in the order the transforms draw them (each op n values), on the generator's device."""
    return [op.values(_draw(generator, n, generator.device)) for op in ops]


def _plan(
    datasets: Sequence[TensorDataset],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    steps: Sequence[BatchTransform] | None,
    offsets: Sequence[int],
    num_steps: int,
    dtype: torch.dtype,
    device: torch.device,
    extra: StepDraws | None = None,
    *,
    batched: bool = True,
    pipelined: bool = False,
    outputs: Mapping[str, BatchOutput] | None = None,
    batch: BatchRoom | None = None,
) -> _Plan:
    """The round's plan. Nodes with CPU generators and a transform `_apply_steps` knows have their plans
    drawn an epoch at a time (`_NodeDraws`; the draws of their objective's, `extra`, a step at a time
    between the batches'), in chunks made as the steps need them where `pipelined`
    (`_chunk_bounds`); any others, a step at a time, before the first step.
    `batched` False draws every node a step at a time (what tests compare the batched plan with).
    `outputs`: room in each step's row for each `BatchOutput`, filled by the round (`_Plan.fill`); `batch`:
    room for each step's augmented batch and its labels too, filled by the round likewise."""
    shape = tuple(datasets[0].x.shape[-2:]) if datasets[0].x.dim() >= 3 else (0, 0)
    ops = _random_ops(steps, shape) if steps is not None else None
    room = _room(outputs or {}, len(datasets), settings.batch_size, batch)
    if ops is None or not batched or any(g.device.type != "cpu" for g in generators):
        return _plan_by_step(
            datasets, settings, generators, steps, ops, offsets, num_steps, dtype, device, extra, room
        )  # fmt: skip
    k, b = len(datasets), settings.batch_size
    nodes = [
        _NodeDraws(data, settings, generator, ops, extra, offset)
        for data, generator, offset in zip(datasets, generators, offsets, strict=True)
    ]
    seen = torch.zeros(k, dtype=torch.float64)
    pinned = pipelined and device.type == "cuda"

    def draw(lo: int, hi: int) -> Packed:
        chunk = _batched_fill(nodes, lo, hi, b, dtype, ops)
        if extra is not None:
            for node, draws in enumerate(nodes):
                draws.fill_drawn(lo, hi, node, chunk)
        seen.add_(chunk.count.double().sum(0))
        drawn = {name: send(t, device, pinned) for name, t in chunk.drawn.items()}
        prepared = extra.prepare(drawn) if extra is not None else {}
        return _packed_steps(chunk.rows, chunk.weight, chunk.count, chunk.values, prepared, device, pinned, room)

    bounds = _chunk_bounds(num_steps, pipelined)
    return _Plan([draw(bounds[0], bounds[1])], bounds, None, seen, draw)


def _plan_by_step(
    datasets: Sequence[TensorDataset],
    settings: TrainSettings,
    generators: Sequence[torch.Generator],
    steps: Sequence[BatchTransform] | None,
    ops: Sequence[_RandomOp] | None,
    offsets: Sequence[int],
    num_steps: int,
    dtype: torch.dtype,
    device: torch.device,
    extra: StepDraws | None,
    room: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> _Plan:
    """The plan drawn a step at a time, node by node, before the first step: for a transform of its own
    (applied here, in the order the node draws) or generators on a device."""
    k, b = len(datasets), settings.batch_size
    rows = torch.zeros((num_steps, k, b), dtype=torch.long)
    weight = torch.zeros((num_steps, k, b), dtype=dtype)
    count = torch.zeros((num_steps, k), dtype=dtype)
    draws: list[torch.Tensor] = []
    inputs: torch.Tensor | None = None
    drawn: dict[str, torch.Tensor] = {}
    for node, (data, generator) in enumerate(zip(datasets, generators, strict=True)):
        state = extra.first(data, settings, generator) if extra is not None else None
        for s, idx in enumerate(node_indices(data, settings, generator)):
            m = len(idx)
            idx = idx.cpu()
            rows[s, node, :m] = idx + offsets[node]
            rows[s, node, m:] = int(idx[0]) + offsets[node]
            weight[s, node, :m] = 1
            count[s, node] = m
            if steps is None:  # a transform of its own: applied here, in the order the node draws
                x = data.train_batch(idx.to(data.x.device), generator)[0]
                if inputs is None:
                    inputs = torch.zeros((num_steps, k, b, *x.shape[1:]), dtype=x.dtype, device=device)
                inputs[s, node, :m] = x.to(device)
                inputs[s, node, m:] = x[:1].to(device)
            else:
                for j, values in enumerate(_draws_of(ops or [], generator, m)):
                    if j == len(draws):
                        draws.append(torch.zeros((num_steps, k, b), dtype=values.dtype))
                    draws[j][s, node, :m] = values.cpu()
            if extra is not None:  # the objective's draws come after the batch's, as in its own training
                for name, values in extra.step(state, s, m, generator).items():
                    if name not in drawn:
                        drawn[name] = torch.zeros((num_steps, k, b, *values.shape[1:]), dtype=values.dtype)
                    drawn[name][s, node, :m] = values.cpu()
                    drawn[name][s, node, m:] = values[:1].cpu()
    prepared = extra.prepare({n: t.to(device) for n, t in drawn.items()}) if extra is not None else {}
    packed = _packed_steps(rows, weight, count, draws, prepared, device, room=room)
    return _Plan([packed], [0, num_steps], inputs, count.double().sum(0))


BATCH_ROOM, LABELS_ROOM = "batch", "labels"
"""The fields of a step's row that hold its augmented batch and its labels, where the round makes them ahead."""


class BatchRoom(NamedTuple):
    """What one sample of a step's batch is, as the round makes it ahead: its input's shape and dtype
    (augmented), its label's dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    label_dtype: torch.dtype


def _room(
    outputs: Mapping[str, BatchOutput], k: int, b: int, batch: BatchRoom | None = None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each `BatchOutput`'s room in a step's row (``step.<name>``: the objective's `NodeBatch.step`) and the
    batch's (`BATCH_ROOM`, `LABELS_ROOM`): (K, B, *shape) of its dtype, made on the device only."""
    room = {f"step.{name}": ((k, b, *out.shape), out.dtype) for name, out in outputs.items()}
    if batch is not None:
        room |= {BATCH_ROOM: ((k, b, *batch.shape), batch.dtype), LABELS_ROOM: ((k, b), batch.label_dtype)}
    return room


def _padded_rows(sizes: torch.Tensor, b: int) -> torch.Tensor:
    """(steps, b) indices into the steps' rows concatenated (`sizes[s]` rows for step s): each step's own
    rows, then its first row again up to `b`."""
    starts = sizes.cumsum(0) - sizes
    j = torch.arange(b)
    return starts.unsqueeze(1) + torch.where(j < sizes.unsqueeze(1), j, 0)


@dataclass(frozen=True, slots=True)
class _RandomOp:
    """One random value per image of a transform step, as `_draws_of` draws it: a crop offset in [0, span),
    a flip (value < p), or an angle in [-degrees, degrees)."""

    kind: str
    span: int = 0
    p: float = 0.0
    degrees: float = 0.0

    @property
    def dtype(self) -> torch.dtype:
        """What `values` gives: an offset's long, a flip's bool, an angle's float32."""
        return torch.long if self.kind == "offset" else (torch.bool if self.kind == "flip" else torch.float32)

    def values(self, uniform: torch.Tensor) -> torch.Tensor:
        if self.kind == "offset":
            return (uniform * self.span).long().clamp_(max=self.span - 1)
        if self.kind == "flip":
            return uniform < self.p
        return (uniform * 2 - 1) * self.degrees


def _random_ops(steps: Sequence[BatchTransform], shape: tuple[int, ...]) -> list[_RandomOp]:
    """The random values of `steps` for images of `shape` (H, W), in `_draws_of`'s order."""
    ops: list[_RandomOp] = []
    h, w = shape[0], shape[1]
    for step in steps:
        if isinstance(step, RandomCrop):
            hp, wp = h + 2 * step.padding, w + 2 * step.padding
            if hp < step.size or wp < step.size:
                raise ValueError(f"a {step.size}-pixel crop of {hp} x {wp} padded images")
            ops += [_RandomOp("offset", span=hp - step.size + 1), _RandomOp("offset", span=wp - step.size + 1)]
            h = w = step.size
        elif isinstance(step, RandomHorizontalFlip):
            ops.append(_RandomOp("flip", p=step.p))
        elif isinstance(step, RandomRotation) and step.degrees != 0:
            ops.append(_RandomOp("angle", degrees=step.degrees))
    return ops


@dataclass
class _ChunkTensors:
    """A chunk's steps on the host, (steps, K, ...) each: made at once for every node (`_batched_fill`),
    an objective's own draws node by node (`_NodeDraws.fill_drawn`)."""

    rows: torch.Tensor
    weight: torch.Tensor
    count: torch.Tensor
    values: list[torch.Tensor]
    """Each random op's values (`_RandomOp`)."""
    drawn: dict[str, torch.Tensor] = field(default_factory=dict)
    """An objective's own draws (`StepDraws`), made by name at the first."""


@dataclass(frozen=True, slots=True)
class _EpochDraws:
    """One epoch of one node: its permutation, its batches' uniform values (batch after batch, each batch
    its ops' values one op after another) and `extra`'s draws, a dict a step."""

    perm: torch.Tensor
    uniform: torch.Tensor
    drawn: list[dict[str, torch.Tensor]]


class _NodeDraws:
    """One node's draws, an epoch at a time as a chunk of the plan first needs the epoch, the same values
    `node_indices` and `_draws_of` draw a batch at a time: a CPU generator gives one draw of n values as
    the same stream as draws of its parts, and an epoch's batches draw [op 1's values, op 2's, ...] one
    batch after another. With `extra` (an objective's own draws, KDIA's noise), whose draws come between
    the batches' in the node's stream, the uniform values are drawn a batch at a time (one draw for all
    the batch's ops), and everything else an epoch at a time still. A node with no step draws its
    epochs' permutations all the same, at once, as its own training would."""

    def __init__(
        self,
        data: TensorDataset,
        settings: TrainSettings,
        generator: torch.Generator,
        ops: Sequence[_RandomOp],
        extra: StepDraws | None,
        offset: int,
    ) -> None:
        self.n, self.size, self.epochs = len(data), settings.batch_size, settings.local_epochs
        self.per = steps_per_epoch(self.n, self.size, settings.drop_last)
        self.full = min(self.per, self.n // self.size)
        self.last = self.n - self.full * self.size if self.per > self.full else 0  # the trailing batch, if any
        self.generator, self.ops, self.extra, self.offset = generator, ops, extra, offset
        self.state = extra.first(data, settings, generator) if extra is not None else None
        self.epoch = -1
        self.drawn: dict[int, _EpochDraws] = {}
        """The epochs drawn that a chunk still reads."""
        if self.per == 0:
            while self.epoch < self.epochs - 1:
                self._next_epoch()
            self.drawn.clear()

    @property
    def steps(self) -> int:
        return self.epochs * self.per

    def _next_epoch(self) -> None:
        self.epoch += 1
        generator, r, size = self.generator, len(self.ops), self.size
        perm = torch.randperm(self.n, generator=generator)
        if self.extra is None:
            uniform = torch.rand(r * (self.full * size + self.last), generator=generator)
            self.drawn[self.epoch] = _EpochDraws(perm, uniform, [])
            return
        parts, drawn = [], []
        first = self.epoch * self.per
        for b, m in enumerate([size] * self.full + ([self.last] if self.last else [])):
            parts.append(torch.rand(r * m, generator=generator))
            drawn.append(self.extra.step(self.state, first + b, m, generator))
        self.drawn[self.epoch] = _EpochDraws(perm, torch.cat(parts) if parts else torch.zeros(0), drawn)

    def epochs_for(self, lo: int, hi: int) -> range:
        """The node's epochs that steps `lo` to `hi` - 1 reach, drawn (those before them let go)."""
        end = min(hi, self.steps)
        if lo >= end:
            return range(0)
        first, last = lo // self.per, (end - 1) // self.per
        while self.epoch < last:
            self._next_epoch()
        for gone in [e for e in self.drawn if e < first]:
            del self.drawn[gone]
        return range(first, last + 1)

    def fill_drawn(self, lo: int, hi: int, node: int, chunk: _ChunkTensors) -> None:
        """`extra`'s draws of the node's steps `lo` to `hi` - 1 (those it has) into its column of the
        chunk's, each step's rows in place and a short batch padded with its first row, as its batch is."""
        size = self.size
        for epoch in self.epochs_for(lo, hi):
            first = epoch * self.per
            a, b = max(lo, first) - first, min(hi, first + self.per) - first  # the epoch's own steps a to b - 1
            steps = self.drawn[epoch].drawn[a:b]
            sizes = torch.tensor([len(next(iter(d.values()))) for d in steps])
            source = _padded_rows(sizes, size)
            at = first + a - lo
            for name in steps[0]:
                got = torch.cat([d[name] for d in steps])
                if name not in chunk.drawn:
                    n, k = chunk.rows.shape[:2]
                    chunk.drawn[name] = torch.zeros((n, k, size, *got.shape[1:]), dtype=got.dtype)
                chunk.drawn[name][at : at + b - a, node] = got[source]


def _batched_fill(
    nodes: Sequence[_NodeDraws], lo: int, hi: int, b: int, dtype: torch.dtype, ops: Sequence[_RandomOp]
) -> _ChunkTensors:
    """Steps `lo` to `hi` - 1 of every node at once: each node's epochs that the chunk reaches are drawn
    (node by node, from its own generator), then every (step, node, slot) finds its row number and its
    ops' values in the concatenated draws with a few tensor operations over the whole chunk, not a few
    per node. A node's batch b of an epoch holds rows b * B onwards of the epoch's permutation (its
    trailing batch the rest, padded with its first row), and its op j's values lie at r B b + j m in the
    epoch's uniform values (m the batch's size, r the ops); a step a node does not have is all zeros."""
    n, k, r = hi - lo, len(nodes), len(ops)
    perms: list[torch.Tensor] = []
    uniforms: list[torch.Tensor] = []
    epochs = max((node.epochs for node in nodes), default=1)
    # where node k's epoch e starts in the concatenations (made as lists: one tensor, not k x e item writes)
    perm_starts, uniform_starts = [[0] * epochs for _ in nodes], [[0] * epochs for _ in nodes]
    perm_len = uniform_len = 0
    for i, node in enumerate(nodes):
        for e in node.epochs_for(lo, hi):
            drawn = node.drawn[e]
            perm_starts[i][e], uniform_starts[i][e] = perm_len, uniform_len
            perms.append(drawn.perm)
            uniforms.append(drawn.uniform)
            perm_len, uniform_len = perm_len + len(drawn.perm), uniform_len + len(drawn.uniform)
    perm_at, uniform_at = torch.tensor(perm_starts), torch.tensor(uniform_starts)
    per, full, last, total, offset = (
        torch.tensor([getattr(node, name) for node in nodes], dtype=torch.long)
        for name in ("per", "full", "last", "steps", "offset")
    )
    s = torch.arange(lo, hi).unsqueeze(1)  # (n, 1)
    active = s < total  # (n, k): the node has step s
    epoch = torch.where(active, s // per.clamp(min=1), 0)
    batch = torch.where(active, s % per.clamp(min=1), 0)
    size = torch.where(batch < full, b, last)  # (n, k): the batch's real rows
    slot = torch.arange(b)
    real = active.unsqueeze(-1) & (slot < size.unsqueeze(-1))  # (n, k, b)
    within = torch.where(real, slot, 0)  # a padding slot repeats the batch's first row
    nodes_ix = torch.arange(k)
    rows = torch.zeros((n, k, b), dtype=torch.long)
    values = [torch.zeros((n, k, b), dtype=op.dtype) for op in ops]
    if perms:
        start = perm_at[nodes_ix, epoch] + batch * b  # (n, k)
        at = torch.where(active.unsqueeze(-1), start.unsqueeze(-1) + within, 0)
        rows = torch.where(active.unsqueeze(-1), torch.cat(perms)[at] + offset.view(1, k, 1), 0)
    if r and uniform_len:
        uniform = torch.cat(uniforms)
        start = uniform_at[nodes_ix, epoch] + r * b * batch
        for j, op in enumerate(ops):
            at = torch.where(real, start.unsqueeze(-1) + j * size.unsqueeze(-1) + within, 0)
            values[j] = torch.where(real, op.values(uniform[at]), values[j])
    count = torch.where(active, size, 0).to(dtype)
    return _ChunkTensors(rows, real.to(dtype), count, values)
