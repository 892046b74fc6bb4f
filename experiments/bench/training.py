"""Training many simulated nodes of one process: one by one against one vectorised computation.

What a node-host process does each round for its K selected nodes, timed both ways in this
process, one after the other, on the same shards and generators: one by one, as the daemons do by
default (load the broadcast model into the shared workspace model, `local_sgd`, next node), and as
one vectorised computation (`fedcore.vectorized.train_vectorized`, what ``hosting.vectorize``
does). Each case also reports the largest difference between the two results over every weight of
every node (float32 rounding), and one case runs in float64, where the two must agree to 1e-12.

The shards have unequal sizes, so the vectorised run pads short batches and stops nodes that run
out of batches, as it does in a federation. The CPU runs use one torch thread, as a node-host
process does (``hosting.threads_per_process``). On a CUDA device the same cases run again with the
shards, the augmentation and the generators on the GPU (data resident: nothing crosses to the
device between steps); that path is skipped, and said to be, where there is none.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.experiments.bench.common import BenchOptions, Report, Timing, measure
from fedmq.fedcore.data import Augment, Split, TensorDataset, load_dataset, load_synthetic, with_transforms
from fedmq.fedcore.models import build_model, count_parameters
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import TrainSettings, local_sgd, torch_threads
from fedmq.fedcore.vectorized import train_vectorized

TITLE = "K simulated nodes of one process: local_sgd one by one against one vectorised computation"

SETTINGS = TrainSettings(local_epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4)
"""The quickstart's training (batch 16, SGD with momentum 0.9), one local epoch, a little weight decay."""
EXACT = 1e-12
"""Largest weight difference allowed in float64, where rounding cannot hide a different computation."""


KDIA_SETTINGS = TrainSettings(local_epochs=1, batch_size=64, lr=0.01, momentum=0.9, weight_decay=1e-5)
"""KDIA's and MOON's node training on CIFAR-10 (batch 64, SGD lr 0.01, momentum 0.9), one local epoch."""


@dataclass(frozen=True, slots=True)
class Case:
    data: str
    """A key of `DATA`."""
    model: str
    k: int
    mean: int | None = None
    """Mean shard size; None: the suite's."""
    settings: TrainSettings = SETTINGS


def digits(augment: bool = False) -> TensorDataset:
    """scikit-learn's digits (1 x 8 x 8, the quickstart's data); with `augment`, a random 1-pixel-padded
    crop and flips, which each node draws from its own generator."""
    choice = {"crop": 8, "padding": 1, "flip": True} if augment else "none"
    return load_dataset("digits", seed=0, augment=choice).train


def mnist_shaped() -> TensorDataset:
    """Synthetic data of MNIST's shape (1 x 28 x 28, 10 classes): Gaussian clusters, clearly not MNIST."""
    train = load_synthetic(seed=0, features=784, train_size=4000, test_size=10).train
    return TensorDataset(train.x.view(-1, 1, 28, 28), train.y, train.num_classes)


def cifar_shaped() -> TensorDataset:
    """Synthetic uint8 images of CIFAR-10's shape (3 x 32 x 32, 10 classes) with CIFAR's crop (padding 4)
    and flip and a normalisation: what a KDIA node's batch costs, on data that is clearly not CIFAR."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (5000, 3, 32, 32), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 10, (5000,), generator=gen)
    data = TensorDataset(x, y, 10)
    normalize = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    return with_transforms(Split(data, data), Augment(crop=32, padding=4, flip=True), normalize).train


DATA: dict[str, Callable[[], TensorDataset]] = {
    "digits": digits,
    "digits, crop and flip": lambda: digits(augment=True),
    "mnist-shaped": mnist_shaped,
    "cifar-shaped, crop and flip": cifar_shaped,
}


def shards(data: TensorDataset, k: int, mean: int, seed: int = 0) -> list[TensorDataset]:
    """K shards of unequal sizes (uniform in [mean/2, 3 mean/2]), each a random subset of `data`
    (nodes overlap when K x mean exceeds it: a benchmark needs their sizes, not disjoint samples)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(mean // 2, mean + mean // 2 + 1, (k,), generator=gen).tolist()
    return [data.subset(torch.randperm(len(data), generator=gen)[:n].numpy()) for n in sizes]


def generators(k: int, device: torch.device) -> list[torch.Generator]:
    return [torch_generator(0, "node-train", f"node-{i:03d}", 0, device=device) for i in range(k)]


States = list[dict[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class OneByOne:
    """What the daemons do: the broadcast model loaded into the one workspace model, local_sgd, next node."""

    workspace: nn.Module
    start: dict[str, torch.Tensor]

    @classmethod
    def of(cls, model: nn.Module) -> OneByOne:
        return cls(copy.deepcopy(model), copy.deepcopy(model.state_dict()))

    def __call__(
        self,
        datasets: Sequence[TensorDataset],
        device: torch.device,
        *,
        keep: bool = False,
        settings: TrainSettings = SETTINGS,
    ) -> States:
        """Train every node; with `keep`, a copy of each result (the daemon's encoding copies it instead)."""
        out = []
        for data, gen in zip(datasets, generators(len(datasets), device), strict=True):
            self.workspace.load_state_dict(self.start)
            local_sgd(self.workspace, data, settings, gen)
            if keep:
                out.append({k: v.detach().clone() for k, v in self.workspace.state_dict().items()})
        return out


def vectorised(
    model: nn.Module, datasets: Sequence[TensorDataset], device: torch.device, settings: TrainSettings = SETTINGS
) -> States:
    return [state for state, _ in train_vectorized(model, datasets, settings, generators(len(datasets), device))]


def max_difference(a: States, b: States) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b, strict=True) for k in x)


def synchronized(call: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """`call`, waiting for the GPU to finish, so that the timing covers the work and not its launch."""

    def run() -> None:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def measure_case(
    case: Case, data: TensorDataset, mean: int, device: torch.device, repeats: int
) -> tuple[Timing, Timing, float, list[int]]:
    """(one by one, vectorised, largest difference of any weight, shard sizes) for one case."""
    model = build_model(case.model, data.input_shape, data.num_classes, seed=0).to(device)
    datasets = [d.to(device) for d in shards(data, case.k, case.mean or mean)]
    one_by_one = OneByOne.of(model)
    s = case.settings
    diff = max_difference(one_by_one(datasets, device, keep=True, settings=s), vectorised(model, datasets, device, s))
    # the two runs above were the warm-up
    alone = measure(synchronized(lambda: one_by_one(datasets, device, settings=s), device), repeats=repeats, warmup=0)
    together = measure(synchronized(lambda: vectorised(model, datasets, device, s), device), repeats=repeats, warmup=0)
    return alone, together, diff, [len(d) for d in datasets]


def float64_difference(case: Case, data: TensorDataset, mean: int, device: torch.device) -> float:
    """The largest weight difference of one case in float64: the two computations agree to its rounding,
    so anything larger in float32 is float32 rounding amplified, not a different computation."""
    model = build_model(case.model, data.input_shape, data.num_classes, seed=0).to(device, torch.float64)
    data = dataclasses.replace(data, x=data.x.double()) if data.x.is_floating_point() else data
    datasets = [d.to(device) for d in shards(data, case.k, mean)]
    return max_difference(OneByOne.of(model)(datasets, device, keep=True), vectorised(model, datasets, device))


def cases(quick: bool) -> tuple[int, list[Case], Case]:
    """(mean shard size, timed cases, the float64 case)."""
    if quick:
        return 12, [Case("digits", "mlp", 3), Case("digits, crop and flip", "cnn", 3)], Case("digits", "cnn", 3)
    timed = [Case("digits", m, k) for m in ("mlp", "cnn") for k in (10, 50)]
    timed += [
        Case("digits, crop and flip", "cnn", 50),
        Case("mnist-shaped", "mlp", 10),
        Case("mnist-shaped", "cnn", 10),
        Case("cifar-shaped, crop and flip", "moon-cnn", 10, mean=500, settings=KDIA_SETTINGS),
    ]
    return 64, timed, Case("digits, crop and flip", "cnn", 10)


def run(options: BenchOptions) -> Report:
    repeats = options.reps(full=3, quick=1)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    mean, timed, exact = cases(options.quick)
    report = Report(
        "train",
        TITLE,
        context={
            "settings": f"1 local epoch, batch {SETTINGS.batch_size}, SGD lr {SETTINGS.lr} momentum"
            f" {SETTINGS.momentum} weight decay {SETTINGS.weight_decay}",
            "shards": f"sizes uniform in [{mean // 2}, {mean + mean // 2}], mean {mean}",
            "CPU torch threads": 1,
            "repeats": repeats,
            "statistic": "median",
            "devices": [str(d) for d in devices],
        },
    )
    loaded = {name: DATA[name]() for name in dict.fromkeys(c.data for c in (*timed, exact))}
    with torch_threads(1):
        for device in devices:
            for case in timed:
                _add_case(report, case, loaded[case.data], mean, device, repeats)
            diff = float64_difference(exact, loaded[exact.data], mean, device)
            report.context.setdefault("float64_difference", {})[str(device)] = diff
            report.target(
                f"in float64, vectorised weights equal one-by-one weights to {EXACT:g} ({exact.model} on"
                f" {exact.data}, K = {exact.k}, {device})",
                f"largest difference {diff:.1e}",
                diff <= EXACT,
            )
    _notes(report, len(devices) > 1)
    return report


def _notes(report: Report, gpu: bool) -> None:
    if not gpu:
        report.notes.append(
            "No CUDA device here: the GPU cases (data, augmentation, generators on the GPU) did not run."
        )
    report.notes += [
        "one by one: per node, the broadcast model loaded into one workspace model, then local_sgd (the daemons'"
        " default); vectorised: fedcore.vectorized.train_vectorized on the same shards and generators"
        " (hosting.vectorize). Times are for one local epoch of all K nodes.",
        "The weight differences are float32 rounding: in float64 the two agree to 1e-12 (the target). Rounding"
        " usually stays below 1e-7, but a near tie in a max-pool or a ReLU can send one step's gradient to"
        " another weight, which shows as one node's larger difference.",
    ]


def _add_case(report: Report, case: Case, data: TensorDataset, mean: int, device: torch.device, repeats: int) -> None:
    alone, together, diff, sizes = measure_case(case, data, mean, device, repeats)
    model = build_model(case.model, data.input_shape, data.num_classes, seed=0)
    shape = "x".join(map(str, data.input_shape))
    section = f"{case.model} ({count_parameters(model):,} parameters) on {case.data} ({shape}), {device}"
    n, batch = sum(sizes), case.settings.batch_size
    note = f"{n} samples, batch {batch}, {n / alone.median:,.0f} images/s"
    report.add(f"K = {case.k}: one by one", alone.median * 1e3, "ms", section=section, note=note)
    report.add(
        f"K = {case.k}: vectorised",
        together.median * 1e3,
        "ms",
        ratio=alone.median / together.median,
        ratio_means="one by one's speed",
        note=f"{n / together.median:,.0f} images/s; largest weight difference {diff:.1e}",
        section=section,
    )
    report.context.setdefault("max_abs_difference", {})[f"{case.model}/{case.data}/K={case.k}/{device}"] = diff
