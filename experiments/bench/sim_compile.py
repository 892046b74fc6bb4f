"""torch.compile beside CUDA graphs: the bare `vmap` step compiled (issue 28: "measure both").

The simulator cuts a step's launches with CUDA graphs (`simulation.graphs`). torch.compile cuts them
another way, with Inductor's fused kernels, and the two combine: a compiled step captured as a graph.
Whether compiling pays on a GPU decides whether the simulator's own step should be compiled next, so
this section times the bare `vmap` reference's step written the way torch.compile takes it whole
(`fullgraph`): `torch.func.grad` inside `vmap` instead of `torch.autograd.grad` over it (which breaks
the graph, and then ran five times slower than eager on the 2-core CPU), the crop, flip and
normalisation and the SGD update in the same function. The augmentation's draws are made outside it,
so the compiled and the eager function read the same values and their updates can be compared.

Rows, each as images a second against the best reference of `fedmq bench sim`'s main section (the
`vmap` step captured as a CUDA graph on a GPU; on a CPU the eager loop or the `vmap` step, both timed
here): the function eager, compiled, and on a GPU each captured as a graph; the compile's own time
(the first call: less where Inductor's cache already holds the kernels, as on a second run); and how
far the compiled step's update lies from the eager function's on the same batch.

Opt-in, since compiling takes tens of seconds a case (20 to 45 s for 3 nodes on the 2-core CPU,
torch 2.13 and 2.11): `fedmq bench sim --opt compile=true`, `python -m fedmq.experiments.bench.simulator
OUT --compile`, or alone, `python -m fedmq.experiments.bench.sim_compile OUT_PREFIX [--quick]`
(`scripts/gpu-tables`' step `compile`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from fedmq.experiments.bench.common import Report, Timing, run_keeping
from fedmq.experiments.bench.simulator import Case, EagerLoop, VmapStep, _timed, cases, workload
from fedmq.fedcore.host_memory import set_host_memory
from fedmq.fedcore.seeding import deterministic_kernels
from fedmq.fedcore.training import torch_threads
from fedmq.fedcore.transforms import crop_at, pad

TITLE = "torch.compile beside CUDA graphs: the bare vmap step compiled"
CROP, PADDING = 32, 4

Update = Callable[..., None]
"""``update(params, bufs, x, y, top, left, flip, negative_lr)``: one SGD step of every node, in place."""


def functional_update(step: VmapStep) -> Update:
    """`step`'s work as one function torch.compile can take whole: the batch's crop at (`top`, `left`),
    flip and normalisation, each node's gradient by `torch.func.grad` mapped over the nodes, and SGD with
    momentum and weight decay as the reference writes it, on `params` and `bufs` in place."""
    model, mean, std = step.model, step.mean, step.std
    settings = step.case.settings

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, params, (x,))
        return -F.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).mean()

    gradients = vmap(grad(loss))

    def update(
        params: dict[str, torch.Tensor],
        bufs: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        top: torch.Tensor,
        left: torch.Tensor,
        flip: torch.Tensor,
        negative_lr: torch.Tensor,
    ) -> None:
        k, b = y.shape
        images = crop_at(pad(x.view(k * b, *x.shape[2:]), PADDING, "zero"), top, left, CROP)
        images = torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)
        images = ((images.float() / 255.0 - mean) / std).view(k, b, *images.shape[1:])
        grads = gradients(params, images, y)
        with torch.no_grad():
            ps, bs = list(params.values()), list(bufs.values())
            g = torch._foreach_add([grads[n] for n in params], ps, alpha=settings.weight_decay)
            torch._foreach_mul_(bs, settings.momentum)
            torch._foreach_add_(bs, g)
            torch._foreach_add_(ps, torch._foreach_mul(bs, negative_lr))

    return update


class FunctionalVmapStep(VmapStep):
    """The `vmap` reference's round with its step as an `Update` (`functional_update`, eager or compiled);
    its draws (crop offsets, flips) made on the device before the function, into buffers a captured graph
    reads."""

    def __init__(self, *args: Any, update: Update | None = None, compiled: bool = False, graph: bool = False) -> None:
        super().__init__(*args)
        n = self.case.k * self.case.settings.batch_size
        self.top = torch.zeros(n, dtype=torch.long, device=self.device)
        self.left = torch.zeros_like(self.top)
        self.flip = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.negative_lr = torch.tensor(-self.case.settings.lr, device=self.device)
        if update is None:
            update = functional_update(self)
            update = torch.compile(update, fullgraph=True, dynamic=False) if compiled else update
        self.update: Update = update
        started = time.perf_counter()
        self.step_idx.copy_(self.idx[:, 0])
        self._draw()
        self.update(*self._copies(), *self._batch(), *self.draws)  # a compiled update compiles here
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.first_call_s = time.perf_counter() - started
        """The first step's time (on copies of the parameters): the compile's, for an update compiled here."""
        if graph:
            self._capture()

    @property
    def draws(self) -> tuple[torch.Tensor, ...]:
        return self.top, self.left, self.flip, self.negative_lr

    def _copies(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {n: p.clone() for n, p in self.params.items()}, {n: b.clone() for n, b in self.bufs.items()}

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[self.rows, self.step_idx], self.y[self.rows, self.step_idx]

    def _draw(self) -> None:
        limit = 2 * PADDING + 1
        self.top.random_(0, limit)
        self.left.random_(0, limit)
        torch.lt(torch.rand(self.flip.shape, device=self.device), 0.5, out=self.flip)

    def _step(self) -> None:
        self._draw()
        self.update(self.params, self.bufs, *self._batch(), *self.draws)


DIFFERENCE_BATCHES = 5


def update_difference(eager: FunctionalVmapStep, compiled: Update) -> float:
    """||compiled update - eager update|| / ||eager update|| over every node's parameters, one step of
    `eager`'s round from its parameters on its first batch with fresh draws: how far compiling moves the
    arithmetic. About 6e-6 in float32 on the 2-core CPU, 10 nodes; 3 of 30 batches were 10 to 200 times
    further. That is the step's own sensitivity, not compiling's: the eager function with nothing changed
    but its pixels divided as a product with 1/255 (last-bit differences) gave the same, about 5e-6 and
    up to 2e-3 for 5 of 30 (2026-11-29, a short script). Most likely a last-bit difference breaks an exact
    tie (a max-pool window, a ReLU at 0) the other way, and a gradient takes another path."""
    eager.step_idx.copy_(eager.idx[:, 0])
    eager._draw()
    start = {n: p.clone() for n, p in eager.params.items()}
    after = []
    for update in (eager.update, compiled):
        params, bufs = eager._copies()
        update(params, bufs, *eager._batch(), *eager.draws)
        after.append(params)
    moved = sum(float((after[0][n].double() - start[n].double()).square().sum()) for n in start)
    apart = sum(float((after[1][n].double() - after[0][n].double()).square().sum()) for n in start)
    return (apart / moved) ** 0.5 if moved else float("nan")


@dataclass(frozen=True)
class Measured:
    timings: dict[str, Timing]
    """Each path's round."""
    compile_s: float
    """The compiled update's first call: its compile."""
    differences: list[float]
    """`update_difference` for `DIFFERENCE_BATCHES` batches, in increasing order."""
    failures: list[str]
    """The paths that could not be built, and why."""


def measure_compiled(case: Case, device: torch.device, repeats: int) -> Measured:
    """The vmap reference's round, the functional step's eager and compiled (each also captured on a GPU),
    the compile's time and the compiled update's distance from the eager one."""
    gpu = device.type == "cuda"
    model, datasets = workload(case, device)
    reference = f"reference: vmap over nodes{', CUDA graph' * gpu}"
    paths: dict[str, Callable[[], None]] = {reference: VmapStep(model, datasets, case, device, graph=gpu)}
    if not gpu:  # a CPU's best reference (fedmq bench sim's main section)
        paths["reference: eager loop"] = EagerLoop(model, datasets, case, device)
    eager = FunctionalVmapStep(model, datasets, case, device)
    compiled = FunctionalVmapStep(model, datasets, case, device, compiled=True)  # compiles once, here
    failures = []
    for label, step in (("eager", eager), ("torch.compile", compiled)):
        name = f"vmap step in torch.func form, {label}"
        paths[name] = step
        if gpu:
            try:  # never run on a GPU yet: a compiled function captured as a graph may fail to capture
                paths[f"{name}, CUDA graph"] = FunctionalVmapStep(
                    model, datasets, case, device, update=step.update, graph=True
                )
            except Exception as exc:  # the other rows still come back
                failures.append(f"{case.label}: {name}, captured as a CUDA graph, failed: {type(exc).__name__}: {exc}")
    differences = sorted(update_difference(eager, compiled.update) for _ in range(DIFFERENCE_BATCHES))
    timings = {name: _timed(path, device, repeats) for name, path in paths.items()}
    return Measured(timings, compiled.first_call_s, differences, failures)


def add_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """The section for each of `fedmq bench sim`'s cases on `device`."""
    gpu = device.type == "cuda"
    for case in cases(quick, gpu):
        measured = measure_compiled(case, device, repeats)
        report.notes.extend(measured.failures)
        timings = measured.timings
        section = f"{case.label}, {device}: torch.compile"
        references = {n: t for n, t in timings.items() if n.startswith("reference")}
        reference_name, reference = min(references.items(), key=lambda item: item[1].median)
        images = case.k * case.size * case.epochs
        for name, timing in timings.items():
            report.add(
                name,
                images / timing.median,
                "images/s",
                ratio=reference.median / timing.median,
                ratio_means=f"the best reference ({reference_name.removeprefix('reference: ')})",
                note=f"{timing.median * 1e3:,.1f} ms a round",
                section=section,
            )
        report.add("torch.compile: the first step (the compile)", measured.compile_s, "s", section=section)
        differences = measured.differences
        report.add(
            "compiled update against the eager function's, one step on the same batch",
            statistics.median(differences),
            "relative",
            note=f"||compiled - eager|| / ||eager's update||, every node's parameters, float32: the median of"
            f" {len(differences)} batches, the largest {max(differences):.1e}",
            section=section,
        )


def run(quick: bool, repeats: int) -> Report:
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    deterministic_kernels(device)  # the references' kernels as fedmq bench sim chooses them
    report = Report(
        "sim-compile",
        TITLE,
        context={
            "model": "moon-cnn",
            "data": "synthetic uint8 3x32x32 (CIFAR-shaped), crop 32 padding 4, flip, normalise",
            "repeats": repeats,
            "statistic": "median",
            "device": str(device),
            "CPU torch threads": 1 if not gpu else torch.get_num_threads(),
            "torch": torch.__version__,
        },
    )
    with torch_threads(1) if not gpu else contextlib.nullcontext():  # one CPU thread, as fedmq bench sim
        add_rows(report, device, repeats, quick)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Writes OUT_PREFIX.json and OUT_PREFIX.md, and prints the markdown."""
    parser = argparse.ArgumentParser(
        prog="python -m fedmq.experiments.bench.sim_compile",
        description="The bare vmap step compiled with torch.compile beside the same step eager and the vmap"
        " reference (each also captured as a CUDA graph on a GPU): whether compiling pays.",
    )
    parser.add_argument("out", type=Path, help="prefix of the .json and .md files written")
    parser.add_argument("--quick", action="store_true", help="the small case only (3 nodes of 128)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds a path, after one warm-up")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    set_host_memory("keep")  # as fedmq simulate and fedmq bench sim run
    report = run_keeping(lambda: run(args.quick, args.repeats), log=lambda text: print(text, file=sys.stderr))
    report.write(args.out)
    print(report.markdown())
    return 130 if report.interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
