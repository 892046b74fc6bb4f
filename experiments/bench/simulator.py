"""The simulator's node training against bare-PyTorch references on the same workload, and
`fedmq simulate` end to end.

KDIA's node workload (issue 28): the MOON CNN on CIFAR-shaped uint8 images (synthetic, clearly not
CIFAR), a random crop with padding 4 and a flip drawn per image, batch 64, SGD lr 0.01 momentum 0.9;
K nodes of equal shards (448 or 512 images: whole batches, so that every path takes the same steps).
Timed in the same run, each as node-training images per second:

- the simulator one by one (`local_sgd` per node: what `fedmq simulate` does with
  simulation.vectorize false, and the daemons by default);
- the simulator vectorised (`fedcore.vectorized.train_vectorized`: every draw first, then static
  steps, replays of a CUDA graph on a GPU);
- bare-PyTorch references with no framework around them: a plain eager loop per node (torch.optim.SGD,
  indices and augmentation drawn on the device, no host sync), the same loop with its step captured
  once as a CUDA graph, `torch.func.vmap` over the nodes (stacked parameters, SGD written out), and
  that vmap step captured as a CUDA graph. On a CPU only the eager references apply.

The figures are ratios to the best reference of the same case. Sections time other workloads: KDIA's
node objective beside FedAvg's (`sim_kdia`), KDIA's generator (`sim_generator`), FedSA's BatchNorm
ResNet-18 (`sim_batch_norm`), FedRCL's GroupNorm ResNet-18 (`sim_group_norm`, not in a CPU's quick suite)
and, with `--opt compile=true`, the bare vmap step compiled (`sim_compile`). Then `fedmq simulate` of the
quickstart: the share of its wall time spent training and its images per second over the whole run.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, get_args
from unittest import mock

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.nn import functional as F

from fedmq.experiments.bench.common import BenchOptions, Report, Timing, measure, run_keeping
from fedmq.experiments.bench.step_cost import StepCost, add_cost_rows, counted, last_step_cost
from fedmq.experiments.bench.training import KDIA_SETTINGS, OneByOne, cifar_shaped, generators, synchronized
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.host_memory import HostMemory, set_host_memory
from fedmq.fedcore.models import FedModel, build_model, count_parameters
from fedmq.fedcore.round_plan import outputs_ahead
from fedmq.fedcore.seeding import CUDNN_CHOICES, cudnn_choice, deterministic_kernels
from fedmq.fedcore.training import TrainSettings, torch_threads
from fedmq.fedcore.transforms import crop_at, pad
from fedmq.fedcore.vectorized import train_vectorized, vectorizes_by_default

TITLE = "simulator node training vs bare PyTorch (eager, CUDA graph, vmap, vmap + graph); fedmq simulate's share"

MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


@dataclass(frozen=True, slots=True)
class Case:
    k: int
    size: int
    epochs: int

    @property
    def settings(self) -> TrainSettings:
        return TrainSettings(**{**KDIA_SETTINGS.to_meta(), "local_epochs": self.epochs})

    @property
    def label(self) -> str:
        return f"{self.k} nodes of {self.size}, {self.epochs} epoch{'s' * (self.epochs > 1)}"


def cases(quick: bool, gpu: bool) -> list[Case]:
    if quick:
        return [Case(3, 128, 1)]
    if gpu:
        return [Case(10, 448, 2), Case(100, 512, 1)]
    return [Case(10, 448, 1)]  # a 2-core CPU: one epoch of the 10-node case


def equal_shards(data: TensorDataset, k: int, size: int) -> list[TensorDataset]:
    gen = torch.Generator().manual_seed(0)
    return [data.subset(torch.randperm(len(data), generator=gen)[:size].numpy()) for _ in range(k)]


# -- the references: bare PyTorch, the same steps, nothing of fedmq's ------------------------------------


class Reference:
    """The workload in bare PyTorch: every node's data stacked on the device, (K, S, B) batch indices
    drawn on the device, crop and flip drawn on the device inside the step."""

    def __init__(self, model: nn.Module, datasets: Sequence[TensorDataset], case: Case, device: torch.device) -> None:
        self.model, self.device, self.case = model, device, case
        self.x = torch.stack([d.x for d in datasets]).to(device)  # (K, N, 3, 32, 32) uint8
        self.y = torch.stack([d.y for d in datasets]).to(device)
        b = case.settings.batch_size
        self.steps = case.epochs * (case.size // b)
        gen = torch.Generator(device=device).manual_seed(0)
        perms = [torch.randperm(case.size, generator=gen, device=device) for _ in range(case.k * case.epochs)]
        self.idx = (
            torch.stack(perms).view(case.k, case.epochs * case.size)[:, : self.steps * b].reshape(case.k, self.steps, b)
        )
        self.mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
        self.start = {n: p.detach().clone() for n, p in model.named_parameters()}

    @staticmethod
    def captured(buffer: torch.Tensor, first: torch.Tensor, step: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`step` captured once as a CUDA graph reading `buffer`, after three warm-up steps on `first`
        on a side stream (as torch.cuda.graphs asks)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                buffer.copy_(first)
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return graph

    def augment(self, x: torch.Tensor) -> torch.Tensor:
        """Crop 32 of 40 (padding 4) and flip, drawn on the device; ToFloat and normalise."""
        n = len(x)
        x = pad(x, 4, "zero")
        top = torch.randint(0, 9, (n,), device=x.device)
        left = torch.randint(0, 9, (n,), device=x.device)
        x = crop_at(x, top, left, 32)
        flip = torch.rand(n, device=x.device) < 0.5
        x = torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)
        return (x.float().div_(255.0) - self.mean) / self.std


class EagerLoop(Reference):
    """Each node in turn: one model, torch.optim.SGD (foreach), a plain training loop."""

    def __init__(self, *args: object, graph: bool = False) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        s = self.case.settings
        self.net = copy.deepcopy(self.model)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=s.lr, momentum=s.momentum, weight_decay=s.weight_decay)
        self.node = torch.zeros((), dtype=torch.long, device=self.device)
        self.step_idx = torch.zeros_like(self.idx[0, 0])
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._capture()

    def _step(self) -> None:
        node = self.node.view(1)  # a tensor index (index_select): a Python one would be baked into the graph
        x = self.augment(self.x.index_select(0, node)[0][self.step_idx])
        loss = F.cross_entropy(self.net(x), self.y.index_select(0, node)[0][self.step_idx])
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()

    def _reset(self, k: int) -> None:
        with torch.no_grad():
            for n, p in self.net.named_parameters():
                p.copy_(self.start[n])
            for state in self.opt.state.values():
                if "momentum_buffer" in state and state["momentum_buffer"] is not None:
                    state["momentum_buffer"].zero_()
        self.node.fill_(k)

    def _capture(self) -> None:
        self._reset(0)
        self.graph = self.captured(self.step_idx, self.idx[0, 0], self._step)

    def __call__(self) -> None:
        for k in range(self.case.k):
            self._reset(k)
            for s in range(self.steps):
                self.step_idx.copy_(self.idx[k, s])
                if self.graph is not None:
                    self.graph.replay()
                else:
                    self._step()


class VmapStep(Reference):
    """All nodes at once: stacked parameters, vmap(functional_call), autograd, SGD with momentum written out."""

    def __init__(self, *args: object, graph: bool = False) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        k = self.case.k
        self.params = {n: p.unsqueeze(0).repeat(k, *([1] * p.dim())) for n, p in self.start.items()}
        self.bufs = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.step_idx = torch.zeros_like(self.idx[:, 0])
        model = self.model

        def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = functional_call(model, params, (x,))
            return -F.log_softmax(logits, -1).gather(-1, y.unsqueeze(-1)).mean()

        self.losses = vmap(loss)
        self.rows = torch.arange(k, device=self.device).unsqueeze(1)
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._capture()

    def _step(self) -> None:
        k, b = self.step_idx.shape
        x = self.augment(self.x[self.rows, self.step_idx].view(k * b, 3, 32, 32)).view(k, b, 3, 32, 32)
        y = self.y[self.rows, self.step_idx]
        leaves = {n: p.detach().requires_grad_() for n, p in self.params.items()}
        grads = torch.autograd.grad(self.losses(leaves, x, y).sum(), list(leaves.values()))
        s = self.case.settings
        with torch.no_grad():
            params, bufs = list(self.params.values()), list(self.bufs.values())
            g = torch._foreach_add(list(grads), params, alpha=s.weight_decay)
            torch._foreach_mul_(bufs, s.momentum)
            torch._foreach_add_(bufs, g)
            torch._foreach_add_(params, bufs, alpha=-s.lr)

    def _reset(self) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.start[n].unsqueeze(0).expand_as(p))
            for buf in self.bufs.values():
                buf.zero_()

    def _capture(self) -> None:
        self.graph = self.captured(self.step_idx, self.idx[:, 0], self._step)

    def __call__(self) -> None:
        self._reset()
        for s in range(self.steps):
            self.step_idx.copy_(self.idx[:, s])
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()


# -- the suite ------------------------------------------------------------------------------------------


def _timed(call: Callable[[], object], device: torch.device, repeats: int) -> Timing:
    return measure(synchronized(call, device), repeats=repeats, warmup=1)


def workload(case: Case, device: torch.device) -> tuple[nn.Module, list[TensorDataset]]:
    """The case's model and its nodes' shards on `device`, as every path and count of the suite takes them."""
    data = cifar_shaped()
    data = TensorDataset(data.x, data.y, data.num_classes, train_transform=data.train_transform)
    model = build_model("moon-cnn", data.input_shape, data.num_classes, seed=0).to(device)
    return model, [d.to(device) for d in equal_shards(data, case.k, case.size)]


def vectorised(
    model: nn.Module, datasets: Sequence[TensorDataset], case: Case, graphs: str | None = None
) -> Callable[[], object]:
    """A round of the simulator's vectorised training of `case` (`graphs`: auto, on, off; default the
    context's), its nodes' generators made afresh each call on the CPU, as the simulator's are."""
    cpu = torch.device("cpu")
    return lambda: train_vectorized(model, datasets, case.settings, generators(case.k, cpu), graphs=graphs)


def measure_case(case: Case, device: torch.device, repeats: int) -> dict[str, Timing]:
    """Every path's time for one round of `case` on `device`."""
    model, datasets = workload(case, device)
    settings = case.settings
    one_by_one = OneByOne.of(model)
    gpu = device.type == "cuda"
    cpu = torch.device("cpu")  # the simulator's node generators are CPU generators, whatever the device
    fresh = vectorised(model, datasets, case)
    paths: dict[str, Callable[[], object]] = {
        "simulator, one by one": lambda: one_by_one(datasets, cpu, settings=settings),
        "simulator, vectorised": fresh,
        "simulator, vectorised, rounds kept": KeptRounds(fresh),
    }
    if gpu:
        paths["simulator, vectorised without graphs"] = vectorised(model, datasets, case, graphs="off")
    # the other side of `simulation.outputs_ahead` (auto: each step's batch made before the steps on a GPU, in
    # the step on a CPU), rounds kept: what making the batches ahead gains or costs on this device
    other = "off" if gpu else "on"
    paths[AHEAD_PATHS[other]] = _outputs_ahead_as(other, KeptRounds(vectorised(model, datasets, case)))
    paths["reference: eager loop"] = EagerLoop(model, datasets, case, device)
    if gpu:
        paths["reference: eager loop, CUDA graph"] = EagerLoop(model, datasets, case, device, graph=True)
    paths["reference: vmap over nodes"] = VmapStep(model, datasets, case, device)
    if gpu:
        paths["reference: vmap over nodes, CUDA graph"] = VmapStep(model, datasets, case, device, graph=True)
    return {name: _timed(call, device, repeats) for name, call in paths.items()}


AHEAD_PATHS = {
    "off": "simulator, vectorised, rounds kept, batches made in each step",
    "on": "simulator, vectorised, rounds kept, batches made ahead (a GPU's way)",
}
"""`measure_case`'s path with `simulation.outputs_ahead` set against the device's default, by the setting."""


def _outputs_ahead_as(mode: str, call: Callable[[], object]) -> Callable[[], object]:
    """`call` with `round_plan.OUTPUTS_AHEAD` at `mode` (on, off) while it runs."""

    def run() -> object:
        with outputs_ahead(mode):
            return call()

    return run


class KeptRounds:
    """A call inside `fedcore.vectorized.keep_rounds`, its kept rounds held from call to call: the first
    (the measurement's warm-up) builds the round and on a GPU captures its graphs; the timed ones train
    in it, as a simulation's later rounds do with `simulation.reuse_rounds`."""

    def __init__(self, call: Callable[[], object]) -> None:
        self.call = call
        self.kept: dict[Hashable, Any] = {}

    def __call__(self) -> object:
        from fedmq.fedcore import vectorized

        token = vectorized.KEPT.set(self.kept)
        try:
            return self.call()
        finally:
            vectorized.KEPT.reset(token)


def step_costs(case: Case, device: torch.device) -> dict[str, StepCost]:
    """What one step dispatches, the copy of its batch's slice into place included: the simulator's
    vectorised step (its last: with equal shards every node trains at every step) and the vmap
    reference's (its second: the first builds what later steps reuse)."""
    model, datasets = workload(case, device)
    cpu = torch.device("cpu")
    ours = last_step_cost(
        lambda: train_vectorized(model, datasets, case.settings, generators(case.k, cpu), graphs="off")
    )
    reference = VmapStep(model, datasets, case, device)
    reference.step_idx.copy_(reference.idx[:, 0])
    reference._step()

    def second() -> None:
        reference.step_idx.copy_(reference.idx[:, 1])
        reference._step()

    return {"simulator, vectorised": ours, "reference: vmap over nodes": counted(second)}


def host_work(case: Case, device: torch.device, repeats: int) -> Timing:
    """A kept round's call with its steps skipped (`run_steps` a no-op): the host's work of the round, its
    plan, the kept round's reset and the results, which the device waits for before the first step and
    after the last; set beside the whole call's time, how much of a round is the host's. On a GPU the
    plan is pipelined (`round_plan.PIPELINE`): only its first chunk is drawn here, the others being
    drawn while the steps run."""
    model, datasets = workload(case, device)
    kept = KeptRounds(vectorised(model, datasets, case))
    with steps_skipped():
        return _timed(kept, device, repeats)


def cudnn_costs(case: Case, device: torch.device, repeats: int) -> dict[str, dict[str, Timing]]:
    """The simulator's kept round and the best reference (the `vmap` step, captured as a CUDA graph on a
    GPU) timed under each of cuDNN's ways of choosing algorithms (`CUDNN_CHOICES`): what fedmq's
    deterministic choice, which makes a GPU run replay bit for bit, costs. Each path is built afresh
    inside its choice: cuDNN picks an algorithm when a convolution first runs, and a graph keeps the
    algorithms it captured."""
    graph = device.type == "cuda"
    costs: dict[str, dict[str, Timing]] = {}
    for choice in CUDNN_CHOICES:
        with cudnn_choice(choice):
            model, datasets = workload(case, device)
            reference = f"reference: vmap over nodes{', CUDA graph' * graph}"
            paths: dict[str, Callable[[], object]] = {
                "simulator, vectorised, rounds kept": KeptRounds(vectorised(model, datasets, case)),
                reference: VmapStep(model, datasets, case, device, graph=graph),
            }
            costs[choice] = {name: _timed(call, device, repeats) for name, call in paths.items()}
    return costs


def _add_cudnn_costs(report: Report, case: Case, device: torch.device, costs: dict[str, dict[str, Timing]]) -> None:
    section = f"{case.label}, {device}: cuDNN's algorithms (deterministic: bitwise replays, fedmq's choice)"
    for choice, timings in costs.items():
        for name, timing in timings.items():
            deterministic = costs["deterministic"][name]
            _rate_row(report, f"{name}, cuDNN {choice}", case.k * case.size * case.epochs, timing, deterministic,
                      "the same path's speed with deterministic algorithms", section)  # fmt: skip


KDIA_SIZES = (1276, 651, 338, 1769, 240, 149, 217, 769, 280, 813)
"""The sizes of 10 shards of KDIA's CIFAR-10 split at beta 0.1 (100 nodes, seed 1), drawn at random as a
round selects its nodes: unequal, as a Dirichlet split makes them. 38% of 10 times the longest node's
steps are the nodes' own."""


ALL_K = "every captured step over all K nodes, masked (before 2026-11-28)"
"""`unequal_shards`' timing of the way before `step_kind`, which its other timing is set against."""


def unequal_shards(device: torch.device, repeats: int, sizes: Sequence[int] = KDIA_SIZES) -> dict[str, Timing]:
    """A kept round of `sizes` (one epoch, KDIA's settings), its captured steps as `step_kind` makes them
    (the first b nodes of those still training) beside every captured step over all K, masked (before
    2026-11-28), which a step's work then followed: the longest node's steps times K."""
    from fedmq.fedcore import vectorized

    data = cifar_shaped()
    model = build_model("moon-cnn", data.input_shape, data.num_classes, seed=0).to(device)
    gen = torch.Generator().manual_seed(0)  # images drawn again for shards larger than the synthetic set
    parts = [data.subset(torch.randint(len(data), (n,), generator=gen).numpy()).to(device) for n in sizes]
    settings = TrainSettings(**{**KDIA_SETTINGS.to_meta(), "local_epochs": 1})
    cpu = torch.device("cpu")

    def round_() -> object:
        return train_vectorized(model, parts, settings, generators(len(parts), cpu))

    every_k = KeptRounds(round_)  # a kept round of its own: its graphs are the old kinds'

    def all_k() -> object:
        with mock.patch.object(vectorized, "step_kind", lambda a, k: (k, a < k)):
            return every_k()

    return {
        "each captured step over the nodes still training (step_kind)": _timed(KeptRounds(round_), device, repeats),
        ALL_K: _timed(all_k, device, repeats),
    }


def _add_unequal(
    report: Report, device: torch.device, timings: dict[str, Timing], sizes: Sequence[int] = KDIA_SIZES
) -> None:
    kind = "a round of KDIA's CIFAR-10 split at beta 0.1" if tuple(sizes) == KDIA_SIZES else "unequal shards"
    section = f"{len(sizes)} nodes of {min(sizes)} to {max(sizes)} images ({kind}), 1 epoch, {device}"
    for name, timing in timings.items():
        _rate_row(report, f"simulator, vectorised, rounds kept: {name}", sum(sizes), timing, timings[ALL_K],
                  "every captured step over all K's speed", section)  # fmt: skip


def steps_skipped() -> contextlib.AbstractContextManager[object]:
    """Inside it, a vectorised call does everything but its steps (`host_work`)."""
    from fedmq.fedcore import vectorized

    return mock.patch.object(vectorized, "run_steps", lambda *_, **__: None)


def _add_case(report: Report, case: Case, device: torch.device, timings: dict[str, Timing]) -> float:
    """Rows for one case; the vectorised simulator's share of the best reference."""
    images = case.k * case.size * case.epochs
    refs = {n: t for n, t in timings.items() if n.startswith("reference")}
    best_name, best = min(refs.items(), key=lambda item: item[1].median)
    against = f"the best reference ({best_name.removeprefix('reference: ')})"
    for name, timing in timings.items():
        _rate_row(report, name, images, timing, best, against, f"{case.label}, {device}")
    return best.median / timings["simulator, vectorised"].median


def _rate_row(
    report: Report, label: str, images: int, timing: Timing, base: Timing, against: str, section: str
) -> None:
    """A round's images a second, as a ratio of `base`'s time to its own (above 1: faster than `against`)."""
    report.add(
        label,
        images / timing.median,
        "images/s",
        ratio=base.median / timing.median,
        ratio_means=against,
        note=f"{timing.median * 1e3:,.1f} ms a round",
        section=section,
    )


def simulate_share(cfg_path: Path, overrides: list[str], device: torch.device) -> dict[str, float]:
    """`fedmq simulate` of an experiment file: wall seconds, the share spent training, images per second."""
    from fedmq.experiments.config import load_config
    from fedmq.experiments.simulate import simulate

    cfg = load_config(cfg_path, overrides)
    from rich.console import Console

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        summary = simulate(cfg, Path(tmp) / "run", device=device, console=Console(quiet=True))
        wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "train_share": float(summary["train_share"] or 0.0),
        "images_per_s": float(summary["images_trained"]) / wall,
        "accuracy": float(summary.get("final_accuracy") or 0.0),
        "vectorized": float(bool(summary["vectorized"])),
    }


def run(options: BenchOptions) -> Report:
    repeats = options.reps(full=3, quick=1)
    gpu = torch.cuda.is_available()
    devices = [torch.device("cuda")] if gpu else [torch.device("cpu")]
    for device in devices:  # the simulator's kernels, as its workspace chooses them; the references share them
        deterministic_kernels(device)
    host_memory = str(options.extra.get("host_memory", "keep"))  # as fedmq simulate keeps it by default
    if host_memory not in get_args(HostMemory):
        raise ConfigError(f"{host_memory!r}: expected keep or system", field="--opt host_memory")
    memory_kept = set_host_memory(cast(HostMemory, host_memory))
    compiled = _switch(options.extra.get("compile", "false"), "--opt compile")
    model = build_model("moon-cnn", (3, 32, 32), 10, seed=0)
    report = Report(
        "sim",
        TITLE,
        context={
            "model": f"moon-cnn ({count_parameters(model):,} parameters)",
            "data": "synthetic uint8 3x32x32 (CIFAR-shaped), crop 32 padding 4, flip, normalise",
            "settings": f"batch {KDIA_SETTINGS.batch_size}, SGD lr {KDIA_SETTINGS.lr}"
            f" momentum {KDIA_SETTINGS.momentum}",
            "repeats": repeats,
            "statistic": "median",
            "devices": [str(d) for d in devices],
            "CPU torch threads": 1 if not gpu else torch.get_num_threads(),
            "cuDNN": "deterministic, every path (what fedmq's training processes choose)" if gpu else "not used",
            "host memory": "freed memory kept in the heap (simulation.host_memory keep, as fedmq simulate's)"
            if memory_kept
            else f"the C library's own policy (host_memory {host_memory})",
        },
    )
    with torch_threads(1) if not gpu else contextlib.nullcontext():
        for device in devices:
            for case in cases(options.quick, gpu):
                timings = measure_case(case, device, repeats)
                share = _add_case(report, case, device, timings)
                host = host_work(case, device, repeats).median
                whole = timings["simulator, vectorised, rounds kept"].median
                report.add(
                    "simulator, rounds kept: the host's work alone",
                    host * 1e3,
                    "ms",
                    ratio=host / whole,
                    ratio_means="the round's time with rounds kept",
                    note="the call with its steps skipped: its plan (on a GPU its first chunk: the rest is drawn"
                    " during the steps), reset and results, which the device waits for",
                    section=f"{case.label}, {device}",
                )
                add_cost_rows(report, step_costs(case, device), "reference: vmap over nodes",
                              f"{case.label}, {device}", whose="the vmap reference's")  # fmt: skip
                if options.quick:
                    continue
                if gpu:
                    _add_cudnn_costs(report, case, device, cudnn_costs(case, device, repeats))
                    best = min(t.median for n, t in timings.items() if n.startswith("reference"))
                    kept = best / timings["simulator, vectorised, rounds kept"].median
                    report.target(
                        f"the simulator's vectorised node training at >= 50% of the best reference ({case.label},"
                        f" {device})",
                        f"{share:.0%} of the best reference; {kept:.0%} with rounds kept (simulation.reuse_rounds)",
                        max(share, kept) >= 0.5,
                    )
                else:
                    cpu_target(report, case, timings)
    if gpu and not options.quick:
        _add_unequal(report, devices[0], unequal_shards(devices[0], repeats))
    with torch_threads(1) if not gpu else contextlib.nullcontext():
        _generator_rows(report, devices[0], repeats, options.quick)
        _kdia_rows(report, devices[0], repeats, options.quick)
        _batch_norm_rows(report, devices[0], repeats, options.quick)
        if gpu or not options.quick:  # a ResNet-18 at 32 x 32: seconds a round on a CPU
            _group_norm_rows(report, devices[0], repeats)
        if compiled:
            _compile_rows(report, devices[0], repeats, options.quick)
    plan_rows(report, options.quick, repeats)
    if str(options.extra.get("simulate", "true")).lower() in ("false", "0", "no"):
        report.notes.append("fedmq simulate's share was not measured (--opt simulate=false).")
    else:
        _simulate_rows(report, options, devices[0])
    return report


def _generator_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """KDIA's generator round (`sim_generator`), its failure noted rather than losing the suite's other
    figures: its GPU path (a fused Adam captured as a graph in the plain loop) was written without a GPU."""
    from fedmq.experiments.bench import sim_generator

    try:
        sim_generator.add_rows(report, device, repeats, quick)
    except Exception as exc:  # a lent GPU's minutes: the other sections' figures still come back
        report.notes.append(f"KDIA's generator section failed on {device}: {type(exc).__name__}: {exc}")


def cpu_target(report: Report, case: Case, timings: dict[str, Timing]) -> None:
    """The CPU's target: vectorised at least as fast as one by one, or one by one chosen automatically. It
    reads `simulation.vectorize: auto`'s rule, not the config model, so that the section runs where
    nothing but torch is installed (a GPU machine before its wheels arrive, run on its CPU)."""
    speedup = timings["simulator, one by one"].median / timings["simulator, vectorised"].median
    report.target(
        f"on a CPU, vectorised at least as fast as one by one, or one by one chosen automatically ({case.label})",
        f"vectorised {speedup:.2f}x one by one's speed; simulation.vectorize auto trains one by one on a CPU",
        speedup >= 1 or not vectorizes_by_default("cpu"),
    )


def _kdia_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """KDIA's node objective beside FedAvg's (`sim_kdia`), its failure noted as the generator's is."""
    from fedmq.experiments.bench import sim_kdia

    try:
        sim_kdia.add_rows(report, device, repeats, quick)
    except Exception as exc:  # a lent GPU's minutes: the other sections' figures still come back
        report.notes.append(f"KDIA's node objective section failed on {device}: {type(exc).__name__}: {exc}")


def _batch_norm_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """FedSA's BatchNorm ResNet-18 one by one, vectorised and in bare PyTorch (`sim_batch_norm`), its failure
    noted as the generator's is: its GPU path (masked BatchNorm in captured graphs) was written without a GPU."""
    from fedmq.experiments.bench import sim_batch_norm

    try:
        sim_batch_norm.add_rows(report, device, repeats, quick)
    except Exception as exc:  # a lent GPU's minutes: the other sections' figures still come back
        report.notes.append(f"FedSA's BatchNorm section failed on {device}: {type(exc).__name__}: {exc}")


def _group_norm_rows(report: Report, device: torch.device, repeats: int) -> None:
    """FedRCL's GroupNorm ResNet-18 one by one, vectorised and in bare PyTorch (`sim_group_norm`), its failure
    noted as the BatchNorm section's is: its GPU path has not run on a GPU."""
    from fedmq.experiments.bench import sim_group_norm

    try:
        sim_group_norm.add_rows(report, device, repeats)
    except Exception as exc:  # a lent GPU's minutes: the other sections' figures still come back
        report.notes.append(f"FedRCL's GroupNorm section failed on {device}: {type(exc).__name__}: {exc}")


def _compile_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """The bare vmap step compiled with torch.compile (`sim_compile`), its failure noted as the generator's
    is: it has not run on a GPU, and Inductor needs a C++ compiler on a CPU."""
    from fedmq.experiments.bench import sim_compile

    try:
        sim_compile.add_rows(report, device, repeats, quick)
    except Exception as exc:  # a lent GPU's minutes: the other sections' figures still come back
        report.notes.append(f"The torch.compile section failed on {device}: {type(exc).__name__}: {exc}")


def _switch(value: object, field: str) -> bool:
    """An on/off option's value (true/false, yes/no, 1/0, on/off), or a ConfigError naming `field`."""
    text = str(value).strip().lower()
    if text in ("true", "yes", "1", "on"):
        return True
    if text in ("false", "no", "0", "off"):
        return False
    raise ConfigError(f"{value!r}: expected true or false", field=field)


def plan_rows(report: Report, quick: bool, repeats: int) -> None:
    """The host's work before a KDIA round's first step, which the GPU waits for: the round's plan (every
    node's permutations, augmentation draws and KDIA's labels and noise, drawn between the batches in
    the node's stream), drawn an epoch at a time (the simulator) beside a step at a time (the per-step
    drawing it is held bitwise to), and the first chunk of the pipelined plan (what a GPU waits for
    since). The generator's features of the noise are left out: the device's work."""
    from fedmq.fedcore import round_plan, vectorized
    from fedmq.fedcore.algorithms.kdia import _GeneratedDraws
    from fedmq.fedcore.algorithms.kdia.generator import build_generator

    class Drawn(_GeneratedDraws):
        def prepare(self, drawn: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return drawn

    k, size, epochs = (3, 128, 2) if quick else (10, 500, 10)
    data = cifar_shaped()
    model = build_model("moon-cnn", data.input_shape, data.num_classes, seed=0)
    datasets = equal_shards(data, k, size)
    settings = TrainSettings(**{**KDIA_SETTINGS.to_meta(), "local_epochs": epochs})
    assert data.train_transform is not None
    steps = vectorized.known_steps(data.train_transform)
    total = epochs * round_plan.steps_per_epoch(size, settings.batch_size, settings.drop_last)
    cpu = torch.device("cpu")
    assert isinstance(model, FedModel)
    draws = Drawn(build_generator(100, model), 100)  # KDIA's noise_dim

    def plan(batched: bool, pipelined: bool = False) -> Callable[[], object]:
        offsets = [i * size for i in range(k)]
        return lambda: round_plan._plan(
            datasets, settings, generators(k, cpu), steps, offsets, total, torch.float32, cpu, draws,
            batched=batched, pipelined=pipelined,
        )  # fmt: skip

    with torch_threads(1):
        by_epoch, by_step = measure(plan(True), repeats=repeats), measure(plan(False), repeats=repeats)
        first = measure(plan(True, pipelined=True), repeats=repeats)  # only its first chunk is drawn here
    section = f"host: a KDIA round's plan, {k} nodes of {size}, {epochs} epochs, one CPU thread"
    report.add(
        "plan drawn an epoch at a time (the simulator)",
        by_epoch.median * 1e3,
        "ms",
        ratio=by_step.median / by_epoch.median,
        ratio_means="faster than a step at a time",
        note="drawn before the first step: on a CPU, or a GPU with simulation.pipeline false",
        section=section,
    )
    report.add("plan drawn a step at a time", by_step.median * 1e3, "ms", section=section)
    report.add(
        "pipelined plan: its first chunk (simulation.pipeline, on a GPU)",
        first.median * 1e3,
        "ms",
        ratio=first.median / by_epoch.median,
        ratio_means="of the whole plan",
        note="what the GPU waits for before the round's first step; the rest is drawn while it trains",
        section=section,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m fedmq.experiments.bench.simulator [--quick] OUT_PREFIX`: the node-training part of the
    suite with nothing but torch and numpy installed (a GPU machine before its wheels arrive); writes
    OUT_PREFIX.json and OUT_PREFIX.md."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out", type=Path, help="prefix of the .json and .md files written")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--host-memory",
        choices=("keep", "system"),
        default="keep",
        help="keep freed host memory in the heap, as fedmq simulate does by default (simulation.host_memory),"
        " or leave the C library's own policy",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the bare vmap step compiled with torch.compile (sim_compile: tens of seconds a case)",
    )
    args = parser.parse_args(argv)
    extra = {"simulate": "false", "host_memory": args.host_memory, "compile": str(args.compile)}
    options = BenchOptions(quick=args.quick, repeats=args.repeats, extra=extra)
    report = run_keeping(lambda: run(options), log=lambda text: print(text, file=sys.stderr))
    report.write(args.out)
    print(report.markdown())
    return 130 if report.interrupted else 0  # fedmq's status for an interrupt (its cli package needs the wheels)


if __name__ == "__main__":
    raise SystemExit(main())


def _simulate_rows(report: Report, options: BenchOptions, device: torch.device) -> None:
    root = Path(__file__).resolve().parents[1]
    runs: list[tuple[str, Path, list[str]]] = [
        ("quickstart", root / "quickstart.yaml", ["rounds=3"] if options.quick else []),
    ]
    for name, path, overrides in runs:
        figures = simulate_share(path, overrides, device)
        report.add(
            f"fedmq simulate {name}: share of wall time training",
            figures["train_share"] * 100,
            "%",
            note=f"{figures['wall_s']:.1f} s wall, {figures['images_per_s']:,.0f} images/s over the run,"
            f" accuracy {figures['accuracy']:.4f}, vectorised {bool(figures['vectorized'])}",
            section=f"fedmq simulate, {device}",
        )
        if name == "quickstart" and device.type == "cpu" and not options.quick:
            report.target(
                "fedmq simulate of the quickstart spends >= 85% of its wall time training (CPU)",
                f"{figures['train_share']:.0%}",
                figures["train_share"] >= 0.85,
            )
