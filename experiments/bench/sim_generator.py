"""KDIA's generator round on its device, beside a plain PyTorch loop of the same steps.

Issue 28 asks for a KDIA cell at the paper's scale in 3 minutes "with the generator at the paper's
2,000 steps a round if the speed allows". The grid trains it 200 steps a round (kdia-beta01.yaml's
reduction), and on an H200 those took 0.23 s a round, timed inside a cell that shared the GPU. This
section of `fedmq bench sim` times a round of the generator's steps as KDIA trains it
(`kdia.generator.train_generator`: torch's fused Adam made afresh, on a GPU the steps after the
warm-up replayed as one captured CUDA graph) beside a plain loop of the same steps (torch's fused Adam,
captured once on a GPU): what a step costs, how far it is from the plain loop, the operators a step dispatches (on a GPU
about one kernel each), and what the paper's 2,000 steps would take a round at that speed. On a GPU it
also times KDIA's round under each of cuDNN's ways of choosing algorithms: the generator is transposed
convolutions, whose backward cuDNN may run otherwise when asked for deterministic algorithms.

The heads are those of a round's uploads (10, as C = 0.1 of 100 nodes), each a MOON CNN drawn from its
own seed; the generator is KDIA's for that model (noise 100, 890,724 parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fedmq.experiments.bench.common import Report, Timing, measure
from fedmq.experiments.bench.simulator import Reference
from fedmq.experiments.bench.step_cost import StepCost, add_cost_rows, counted, last_step_cost
from fedmq.experiments.bench.training import synchronized
from fedmq.fedcore.algorithms.kdia import Hyperparams
from fedmq.fedcore.algorithms.kdia import generator as kdia_generator
from fedmq.fedcore.algorithms.kdia.generator import (
    FeatureGenerator,
    HeadEnsemble,
    build_generator,
    diversity_loss,
    generator_draws,
    train_generator,
)
from fedmq.fedcore.models import build_model
from fedmq.fedcore.models.base import FedModel
from fedmq.fedcore.seeding import CUDNN_CHOICES, cudnn_choice

_KDIA = Hyperparams()
"""KDIA's defaults, the paper's (kdia.md 1.6): the generator's steps, batch, noise and Adam."""
PAPER_STEPS = _KDIA.gen_epochs * _KDIA.gen_batches_per_epoch
"""The paper's generator steps a round (10 epochs of 200 batches)."""
GRID_STEPS = _KDIA.gen_batches_per_epoch
"""kdia-beta01.yaml's: one epoch of the paper's batches."""
PAPER_ROUNDS = 200
HEADS = 10
NOISE_DIM, BATCH = _KDIA.noise_dim, _KDIA.gen_batch_size
LR, WEIGHT_DECAY = _KDIA.gen_lr, _KDIA.gen_weight_decay
KDIA = "generator round as KDIA trains it"
PLAIN = "reference: a plain loop of the same steps, fused Adam"


@dataclass(frozen=True, slots=True)
class GeneratorWork:
    """What every path trains: a fresh generator's weights and the round's frozen heads."""

    generator: FeatureGenerator
    ensemble: HeadEnsemble
    steps: int
    device: torch.device


def generator_work(device: torch.device, steps: int) -> GeneratorWork:
    models = [build_model("moon-cnn", (3, 32, 32), 10, seed=seed) for seed in range(HEADS)]
    model = models[0]
    assert isinstance(model, FedModel)
    generator = build_generator(NOISE_DIM, model)
    generator.reset_parameters(torch.Generator().manual_seed(0))
    ensemble = HeadEnsemble(model, [m.state_dict() for m in models], [1.0] * HEADS, device)
    return GeneratorWork(generator.to(device), ensemble, steps, device)


def kdia_round(work: GeneratorWork) -> Callable[[], object]:
    """A round as KDIA's coordinator half trains it, from the same starting weights each call."""
    start = copy.deepcopy(work.generator)

    def call() -> object:
        generator = copy.deepcopy(start)
        return train_generator(
            generator, work.ensemble, epochs=1, batches_per_epoch=work.steps, batch_size=BATCH, lr=LR,
            weight_decay=WEIGHT_DECAY, rng=torch.Generator().manual_seed(0), device=work.device,
        )  # fmt: skip

    return call


class PlainLoop:
    """The same steps written plainly: static inputs, torch's fused Adam (one kernel for every parameter),
    the whole step captured once as a CUDA graph on a GPU and replayed for each step."""

    def __init__(self, work: GeneratorWork, capture: bool = True) -> None:
        self.work = work
        self.net = copy.deepcopy(work.generator).train()
        self.start = copy.deepcopy(self.net.state_dict())
        gpu = work.device.type == "cuda"
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True, capturable=gpu)
        labels, noise = generator_draws(
            epochs=1, batches_per_epoch=work.steps, batch_size=BATCH, noise_dim=NOISE_DIM, num_classes=10,
            rng=torch.Generator().manual_seed(0),
        )  # fmt: skip
        self.labels, self.noise = labels.to(work.device), noise.to(work.device)
        self.y, self.z = self.labels[0].clone(), self.noise[0].clone()
        # warmed on a side stream and captured once, as the simulator bench's references are
        self.graph = Reference.captured(self.y, self.labels[0], self.step) if gpu and capture else None

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        features = self.net(self.z, self.y)
        loss = F.cross_entropy(self.work.ensemble(features), self.y) + diversity_loss(self.z, features)
        loss.backward()
        self.opt.step()

    def __call__(self) -> None:
        with torch.no_grad():
            self.net.load_state_dict(self.start)
        for s in range(self.work.steps):
            self.y.copy_(self.labels[s])
            self.z.copy_(self.noise[s])
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()


def step_costs(work: GeneratorWork) -> dict[str, StepCost]:
    """What one step dispatches, its inputs' copy included: KDIA's and the plain loop's (eagerly: a
    captured step replays the same kernels)."""
    kdia = last_step_cost(kdia_round(GeneratorWork(work.generator, work.ensemble, 4, work.device)), kdia_generator)
    plain = PlainLoop(GeneratorWork(work.generator, work.ensemble, 4, work.device), capture=False)
    plain.step()  # the optimiser's state made, as KDIA's warm-up makes it

    def second() -> None:
        plain.y.copy_(plain.labels[1])
        plain.z.copy_(plain.noise[1])
        plain.step()

    return {KDIA: kdia, PLAIN: counted(second)}


def timings(work: GeneratorWork, repeats: int) -> dict[str, Timing]:
    paths: dict[str, Callable[[], object]] = {KDIA: kdia_round(work), PLAIN: PlainLoop(work)}
    return {name: measure(synchronized(call, work.device), repeats=repeats, warmup=1) for name, call in paths.items()}


def cudnn_costs(device: torch.device, steps: int, repeats: int) -> dict[str, Timing]:
    """KDIA's round under each of cuDNN's ways of choosing algorithms, each built and warmed inside it."""
    out: dict[str, Timing] = {}
    for choice in CUDNN_CHOICES:
        with cudnn_choice(choice):
            out[choice] = measure(synchronized(kdia_round(generator_work(device, steps)), device), repeats=repeats)
    return out


def add_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """The section's rows: each path's round and step, their operators a step, the paper's 2,000 steps a
    round at KDIA's speed (arithmetic on the figure, said so), and on a GPU cuDNN's three ways."""
    gpu = device.type == "cuda"
    steps = 4 if quick else (GRID_STEPS if gpu else 20)
    work = generator_work(device, steps)
    section = f"KDIA's generator: a round of {steps} steps (batch {BATCH}, {HEADS} heads), {device}"
    times = timings(work, repeats)
    plain = times[PLAIN].median
    for name, timing in times.items():
        label = name + (", captured as a CUDA graph" if gpu else "")
        per_step = timing.median / steps
        note = f"{per_step * 1e3:.3f} ms a step"
        if name == KDIA:
            paper = per_step * PAPER_STEPS
            note += (
                f"; at this speed the paper's {PAPER_STEPS:,} steps would take {paper:.2f} s a round,"
                f" {paper * PAPER_ROUNDS / 60:.1f} min over {PAPER_ROUNDS} rounds (arithmetic, not timed)"
            )
        report.add(label, timing.median * 1e3, "ms", ratio=plain / timing.median,
                   ratio_means="the plain loop's speed", note=note, section=section)  # fmt: skip
    cpu_adam = "" if gpu else "; on a CPU torch's Adam steps each parameter in turn, on a GPU all at once"
    add_cost_rows(report, step_costs(work), PLAIN, section, whose="the plain loop's", ops_note=cpu_adam)
    if gpu and not quick:
        costs = cudnn_costs(device, steps, repeats)
        for choice, timing in costs.items():
            report.add(f"{KDIA}, cuDNN {choice}", timing.median * 1e3, "ms",
                       ratio=costs["deterministic"].median / timing.median,
                       ratio_means="the speed with deterministic algorithms", section=section)  # fmt: skip
