"""FedRCL's node training (a GroupNorm ResNet-18) one by one, vectorised, and in bare PyTorch.

FedRCL's Table 1 trains a ResNet-18 with GroupNorm (two groups, the CIFAR stem) on CIFAR-10: 100 nodes,
5 a round, 5 epochs of batch 50, SGD at lr 0.1 with weight decay 1e-3 and each node's gradient clipped to
norm 10, 1,000 rounds (experiments/papers/fedrcl.yaml). This section of `fedmq bench sim` times a round
of that node training (FedAvg's objective: FedRCL's own terms ride on the same step) on synthetic
CIFAR-shaped images (clearly not CIFAR), Normalize(0.5), without the paper's rotation, crop and flip:

- the simulator one by one (`local_sgd` per node);
- the simulator vectorised, each GroupNorm one kernel over the nodes (`fedcore.layers_over_nodes`), and on a
  GPU with rounds kept (its steps replays of captured CUDA graphs);
- a bare-PyTorch reference: `torch.func.vmap` over the nodes with torch's own GroupNorm (vmap's rule:
  the input copied into node order, the scale and shift apart), clipping and SGD written out, captured
  as a CUDA graph on a GPU.

Ratios are to the reference, with each step's operators. A last row gives what a FedRCL cell's node
training (1,000 rounds of 5 nodes x 500 images x 5 epochs) would take at the vectorised speed:
arithmetic on the figure, said so, not timed. Not run on a CPU's quick suite: a ResNet-18 at 32 x 32
trains about 40 images a second on one CPU thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedmq.experiments.bench.common import Report, measure
from fedmq.experiments.bench.sim_batch_norm import (
    CPU,
    VmapBatchStatistics,
    Workload,
    add_path_rows,
    second_step_cost,
    workload,
)
from fedmq.experiments.bench.simulator import KeptRounds
from fedmq.experiments.bench.step_cost import StepCost, last_step_cost
from fedmq.experiments.bench.training import OneByOne, generators, synchronized
from fedmq.fedcore.models import build_model, count_parameters
from fedmq.fedcore.training import TrainSettings
from fedmq.fedcore.vectorized import train_vectorized

SETTINGS = TrainSettings(local_epochs=1, batch_size=50, lr=0.1, momentum=0.0, weight_decay=1e-3, max_grad_norm=10.0)
"""fedrcl.yaml's training, one epoch (its lr decays from round to round, not within one)."""
CELL_IMAGES, CELL_ROUNDS = 5 * 500 * 5, 1_000
"""A FedRCL cell's node-training images a round (5 nodes of CIFAR-10's 500 a node, 5 epochs) and rounds."""
ONE_BY_ONE = "simulator, one by one"
VECTORISED = "simulator, vectorised (each GroupNorm one kernel over the nodes)"
KEPT = "simulator, vectorised, rounds kept"
REFERENCE = "reference: vmap over nodes, torch's GroupNorm"
CLIP_EPS = 1e-6
"""clip_grad_norm_'s max_norm / (total_norm + 1e-6)."""


def model() -> torch.nn.Module:
    return build_model("resnet18", (3, 32, 32), 10, seed=0, norm="gn", groups=2, stem="cifar")


class VmapGroupNorm(VmapBatchStatistics):
    """All nodes at once in bare PyTorch, with torch's GroupNorm under vmap's own rule: the simulator's
    steps (each node's batches in its generator's order), each node's gradient clipped to norm 10 and SGD
    with weight decay written out."""

    settings = SETTINGS

    def update(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
        max_norm = self.settings.max_grad_norm
        assert max_norm is not None
        coef = (max_norm / (torch.linalg.vector_norm(norms, dim=1) + CLIP_EPS)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
        torch._foreach_add_(grads, params, alpha=self.settings.weight_decay)
        torch._foreach_add_(params, grads, alpha=-self.settings.lr)


def vectorised(work: Workload) -> Callable[[], object]:
    return lambda: train_vectorized(work.model, work.datasets, SETTINGS, generators(len(work.datasets), CPU))


def shape(device: torch.device) -> tuple[int, int]:
    """(nodes, images each): a FedRCL round's 5 nodes of 500 on a GPU (10 steps each: past the graphs'
    warm-up), 2 of 50 on a CPU."""
    return (5, 500) if device.type == "cuda" else (2, 50)


def add_rows(report: Report, device: torch.device, repeats: int, k: int | None = None, size: int | None = None) -> None:
    """The section on `device`, `k` nodes of `size` images (default `shape`)."""
    default_k, default_size = shape(device)
    k, size = k or default_k, size or default_size
    work = workload(device, k, size, model())
    section = (
        f"FedRCL's ResNet-18 with GroupNorm ({count_parameters(work.model):,} parameters): {k} nodes of {size},"
        f" batch {SETTINGS.batch_size}, {device}"
    )
    one_by_one = OneByOne.of(work.model)
    paths: dict[str, Callable[[], object]] = {
        ONE_BY_ONE: lambda: one_by_one(work.datasets, CPU, settings=SETTINGS),
        VECTORISED: vectorised(work),
    }
    if device.type == "cuda":
        paths[KEPT] = KeptRounds(vectorised(work))
    paths[REFERENCE] = VmapGroupNorm(work)
    times = {name: measure(synchronized(call, device), repeats=repeats, warmup=1) for name, call in paths.items()}
    cell = ("FedRCL", CELL_ROUNDS, CELL_IMAGES, (VECTORISED, KEPT))
    add_path_rows(report, work.images, times, step_costs(work), REFERENCE, cell, section)


def step_costs(work: Workload) -> dict[str, StepCost]:
    """What a step dispatches (`step_cost`): the vectorised step's (its last, eager) and the reference's
    (its second: the first builds what later steps reuse)."""
    k = len(work.datasets)
    ours = last_step_cost(
        lambda: train_vectorized(work.model, work.datasets, SETTINGS, generators(k, CPU), graphs="off")
    )
    return {VECTORISED: ours, REFERENCE: second_step_cost(VmapGroupNorm(work, capture=False))}
