"""FedSA's node training (a BatchNorm ResNet-18) one by one, vectorised, and in bare PyTorch.

FedSA's Table 1 trains torchvision's ResNet-18 (ImageNet stem, BatchNorm) on CIFAR-10 with PFLlib's
defaults: 20 nodes, every node every round, 1 epoch of batch 10, plain SGD at lr 0.005, no augmentation,
Normalize(0.5), 1,000 rounds. Until 2026-11-28 vectorised training refused BatchNorm, so those cells
trained one node after another. This section of `fedmq bench sim` times a round of that workload on
synthetic CIFAR-shaped images (clearly not CIFAR), each as node-training images per second:

- the simulator one by one (`local_sgd` per node);
- the simulator vectorised (`fedcore.masked_norm`: each node's own running statistics; at a step of
  whole batches, all of them here, torch's own BatchNorm), and on a GPU with rounds kept (its steps
  replays of captured CUDA graphs);
- the simulator vectorised with every step's statistics masked to the nodes' real samples, as a padded
  step's are (`masked_at_every_step`; every step took them before 2026-11-28): what torch's BatchNorm
  at whole batches saves;
- a bare-PyTorch reference: `torch.func.vmap` over the nodes with torch's own BatchNorm in batch-statistics
  mode (no running statistics, whole batches so no padding: the least a vectorised step can do), SGD
  written out, captured as a CUDA graph on a GPU.

Ratios are to the reference. A last row gives what a FedSA cell's node training (1,000 rounds of the
pooled split's 44,992 training images) would take at the vectorised speed: arithmetic on the figure,
said so, not timed.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fedmq.experiments.bench.common import Report, Timing, measure
from fedmq.experiments.bench.simulator import KeptRounds, Reference
from fedmq.experiments.bench.step_cost import StepCost, add_cost_rows, counted, last_step_cost
from fedmq.experiments.bench.training import OneByOne, generators, synchronized
from fedmq.fedcore.data import Split, TensorDataset, with_transforms
from fedmq.fedcore.masked_norm import masked_at_every_step
from fedmq.fedcore.models import build_model, count_parameters
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.vectorized import train_vectorized

SETTINGS = TrainSettings(local_epochs=1, batch_size=10, lr=0.005, momentum=0.0, weight_decay=0.0)
"""fedsa.yaml's training (PFLlib's defaults)."""
CELL_IMAGES, CELL_ROUNDS = 44_992, 1_000
"""A FedSA cell's node-training images a round (the pathological split's pooled 75%, measured in
stop 45's note) and its rounds."""
CPU = torch.device("cpu")
"""Where the simulator draws the nodes' generators (as `fedmq simulate` does)."""
ONE_BY_ONE = "simulator, one by one"
VECTORISED = "simulator, vectorised (torch's BatchNorm at whole batches)"
MASKED = "simulator, vectorised, every step's BatchNorm masked"
KEPT = "simulator, vectorised, rounds kept"
REFERENCE = "reference: vmap over nodes, torch's BatchNorm (batch statistics only)"


@dataclass(frozen=True, slots=True)
class Workload:
    model: nn.Module
    datasets: list[TensorDataset]
    device: torch.device

    @property
    def images(self) -> int:
        return sum(len(d) for d in self.datasets)


def workload(device: torch.device, k: int, size: int, model: nn.Module | None = None) -> Workload:
    """FedSA's ResNet-18 (or `model`) and K shards of `size` synthetic uint8 images, Normalize(0.5), no
    augmentation."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (k * size, 3, 32, 32), dtype=torch.uint8, generator=gen)
    data = TensorDataset(x, torch.randint(0, 10, (k * size,), generator=gen), 10)
    data = with_transforms(Split(data, data), None, ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))).train
    parts = [data.subset(np.arange(i * size, (i + 1) * size)).to(device) for i in range(k)]
    if model is None:
        model = build_model("resnet18", (3, 32, 32), 10, seed=0, stem="imagenet", norm="bn")
    return Workload(model.to(device), parts, device)


def vectorised(work: Workload, masked: bool = False) -> Callable[[], object]:
    """The simulator's vectorised round; `masked`: with every step's BatchNorm statistics masked."""

    def call() -> object:
        with masked_at_every_step() if masked else contextlib.nullcontext():
            return train_vectorized(work.model, work.datasets, SETTINGS, generators(len(work.datasets), CPU))

    return call


class VmapBatchStatistics:
    """All nodes at once in bare PyTorch: stacked parameters, vmap(functional_call) with torch's BatchNorm
    normalising by the batch's statistics and keeping none, plain SGD written out; every node's images
    normalised once beforehand (FedSA has no augmentation), in the order its generator shuffles them, and
    indexed by step: the simulator's steps (tests/experiments/test_bench_sim_batch_norm.py)."""

    settings = SETTINGS
    """The training it writes out (plain SGD, no weight decay, no clipping: FedSA's)."""

    def __init__(self, work: Workload, capture: bool = True) -> None:
        self.model = copy.deepcopy(work.model)
        for module in self.model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.track_running_stats = False
                module.running_mean = module.running_var = module.num_batches_tracked = None
        k, b = len(work.datasets), self.settings.batch_size
        self.steps = min(len(d) for d in work.datasets) // b
        # each node's first epoch in the order its own generator shuffles it, as the simulator's paths draw it
        gens = generators(k, CPU)
        rows = [torch.randperm(len(d), generator=g)[: self.steps * b] for d, g in zip(work.datasets, gens, strict=True)]
        x = torch.stack([d.x[r.to(d.x.device)] for d, r in zip(work.datasets, rows, strict=True)])
        self.x = x.float().div_(255.0).sub_(0.5).div_(0.5).view(k, self.steps, b, 3, 32, 32)
        y = torch.stack([d.y[r.to(d.y.device)] for d, r in zip(work.datasets, rows, strict=True)])
        self.y = y.view(k, self.steps, b)
        self.start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.params = {n: p.unsqueeze(0).repeat(k, *([1] * p.dim())) for n, p in self.start.items()}
        self.cur_x, self.cur_y = self.x[:, 0].clone(), self.y[:, 0].clone()
        model = self.model

        def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        self.losses = vmap(loss)
        gpu = work.device.type == "cuda"
        self.graph = Reference.captured(self.cur_x, self.x[:, 0], self.step) if gpu and capture else None

    def step(self) -> None:
        leaves = {n: p.detach().requires_grad_() for n, p in self.params.items()}
        grads = torch.autograd.grad(self.losses(leaves, self.cur_x, self.cur_y).sum(), list(leaves.values()))
        with torch.no_grad():
            self.update(list(self.params.values()), list(grads))

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Plain SGD, every node at once."""
        torch._foreach_add_(params, grads, alpha=-self.settings.lr)

    def __call__(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.start[n].unsqueeze(0).expand_as(p))
        for s in range(self.steps):
            self.cur_x.copy_(self.x[:, s])
            self.cur_y.copy_(self.y[:, s])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()


def timings(work: Workload, repeats: int) -> dict[str, Timing]:
    one_by_one = OneByOne.of(work.model)  # the simulator's node generators are CPU generators, on any device
    paths: dict[str, Callable[[], object]] = {
        ONE_BY_ONE: lambda: one_by_one(work.datasets, CPU, settings=SETTINGS),
        VECTORISED: vectorised(work),
        MASKED: vectorised(work, masked=True),
    }
    if work.device.type == "cuda":
        paths[KEPT] = KeptRounds(vectorised(work))
    paths[REFERENCE] = VmapBatchStatistics(work)
    return {name: measure(synchronized(call, work.device), repeats=repeats, warmup=1) for name, call in paths.items()}


def step_costs(work: Workload) -> dict[str, StepCost]:
    """What a step dispatches (`step_cost`): the vectorised step's (its last, eager) and the reference's
    (its second: the first builds what later steps reuse)."""
    k = len(work.datasets)

    def cost(masked: bool) -> StepCost:
        with masked_at_every_step() if masked else contextlib.nullcontext():
            return last_step_cost(
                lambda: train_vectorized(work.model, work.datasets, SETTINGS, generators(k, CPU), graphs="off")
            )

    return {
        VECTORISED: cost(False),
        MASKED: cost(True),
        REFERENCE: second_step_cost(VmapBatchStatistics(work, capture=False)),
    }


def second_step_cost(reference: VmapBatchStatistics) -> StepCost:
    """What `reference`'s second step dispatches (its first builds what later steps reuse)."""
    reference.step()

    def second() -> None:
        reference.cur_x.copy_(reference.x[:, 1 % reference.steps])
        reference.cur_y.copy_(reference.y[:, 1 % reference.steps])
        reference.step()

    return counted(second)


def add_path_rows(
    report: Report,
    images_per_round: int,
    times: dict[str, Timing],
    costs: dict[str, StepCost],
    reference: str,
    cell: tuple[str, int, int, tuple[str, ...]],
    section: str,
    whose: str = "the vmap reference's",
) -> None:
    """Each path's images a second against `reference`'s (`whose`, as the ratios name it), `cell` = (whose
    cell, its rounds, its images a round, the paths given what that cell's node training would take at
    their speed), then each step's operators and memory traffic against the reference's."""
    cell_name, rounds, images, cell_paths = cell
    for name, timing in times.items():
        rate = images_per_round / timing.median
        note = f"{timing.median * 1e3:,.1f} ms a round"
        if name in cell_paths:
            note += (
                f"; at this speed a {cell_name} cell's node training ({rounds:,} rounds of {images:,} images)"
                f" would take {minutes_text(images * rounds / rate / 60)} (arithmetic, not timed)"
            )
        report.add(name, rate, "images/s", ratio=times[reference].median / timing.median,
                   ratio_means=f"{whose} speed", note=note, section=section)  # fmt: skip
    add_cost_rows(report, costs, reference, section, whose=whose)


def minutes_text(minutes: float) -> str:
    """Minutes as a cell's arithmetic gives them: a tenth where they are few."""
    return f"{minutes:,.1f} min" if minutes < 10 else f"{minutes:,.0f} min"


def shape(device: torch.device, quick: bool) -> tuple[int, int]:
    """(nodes, images each): FedSA's 20 nodes on a GPU (10 steps each: past the graphs' warm-up), 4 on a
    CPU, 2 quick."""
    if quick:
        return 2, 20
    return (20, 100) if device.type == "cuda" else (4, 20)


def add_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    k, size = shape(device, quick)
    work = workload(device, k, size)
    params = count_parameters(work.model)
    section = f"FedSA's ResNet-18 with BatchNorm ({params:,} parameters): {k} nodes of {size}, batch 10, {device}"
    cell = ("FedSA", CELL_ROUNDS, CELL_IMAGES, (VECTORISED, MASKED, KEPT))
    add_path_rows(report, work.images, timings(work, repeats), step_costs(work), REFERENCE, cell, section)
