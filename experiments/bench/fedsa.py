"""FedSA's aggregation cost: SA against the weighted mean as the number of updates held grows.

The issue: "Its cost grows with the number of updates held at once: measure it, and keep it
vectorised". For each K, K synthetic updates (the global model plus seeded per-client noise with a
right-skewed, log-normal distribution, so that the cross-client distribution of each parameter is
skewed as the paper describes) go through `fedcore.aggregation.weighted_average` (the reference)
and through `fedcore.aggregation.skew_aware.skew_aware_average`, each in a fresh child process so that
each figure is its own: the mean time of a call (after one untimed warm-up call on CUDA) and the
peak memory above what the K updates already take (resident memory on the CPU, the peak of the
CUDA allocator on a GPU). SA's time is reported as a multiple of the mean's, measured in the same
run; its share of high-dispersion parameters and its mean number of clusters per clustered tensor
go beside it. Nothing goes over the bus and nothing trains: this measures the rule.

Settings (``--opt key=value``): ``model`` (resnet18, with GroupNorm), ``input_shape`` (3,32,32),
``params`` (0: the model; else synthetic tensors of this many values), ``updates`` (5,10,20,50),
``c_mic`` (4), ``s_mac`` (4), ``cv_clip_quantile`` (1), ``noise`` (0.05, in units of each
tensor's std), ``device`` (cpu), ``threads`` (1); ``--repeats`` timed calls per K and rule (2).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from fedmq.experiments.bench.common import MIB, BenchOptions, Report
from fedmq.experiments.bench.procs import self_status
from fedmq.fedcore.errors import ConfigError

TITLE = "FedSA's skew-aware aggregation against the weighted mean, as the number of updates held grows"

RULES = ("mean", "sa")

_CTX = mp.get_context("spawn")  # each rule and K in a fresh process: its memory is its own


@dataclass(frozen=True, slots=True)
class Settings:
    """The suite's settings; each can be set with ``--opt key=value`` (lists: comma-separated)."""

    model: str = "resnet18"
    """A model of fedcore.models (ResNets with GroupNorm)."""
    input_shape: tuple[int, ...] = (3, 32, 32)
    params: int = 0
    """Synthetic tensors of this many values in all instead of the model (0: the model)."""
    updates: tuple[int, ...] = (5, 10, 20, 50)
    """K: the numbers of updates held at once."""
    repeats: int = 2
    """Timed calls per K and rule."""
    c_mic: int = 4
    """FedSA's C_mic (CIFAR-10's)."""
    s_mac: int = 4
    """FedSA's S_mac (CIFAR-10's)."""
    cv_clip_quantile: float = 1.0
    noise: float = 0.05
    """Client noise, in units of each tensor's std."""
    device: str = "cpu"
    threads: int = 1
    """torch CPU threads of each child process."""


QUICK = Settings(params=1000, updates=(3,), repeats=1)
"""--quick: three synthetic tensors of 1,000 values in all, K = 3: checks that it all runs."""


def settings(options: BenchOptions) -> Settings:
    base = QUICK if options.quick else Settings()
    types = {f.name: type(getattr(base, f.name)) for f in fields(Settings)}
    changes: dict[str, Any] = {}
    for key, value in options.extra.items():
        if key not in types:
            raise ConfigError(f"--opt {key}: unknown setting; see experiments/bench/fedsa.py")
        try:
            if types[key] is tuple:
                changes[key] = tuple(int(x) for x in str(value).split(",") if x)
            else:
                changes[key] = types[key](value)
        except ValueError:
            raise ConfigError(f"--opt {key}={value!r}: expected {types[key].__name__}") from None
    if options.repeats is not None:
        changes["repeats"] = options.repeats
    s = replace(base, **changes)
    if not s.updates or min(s.updates) < 1 or s.repeats < 1 or s.params < 0 or s.threads < 1:
        raise ConfigError("updates, repeats and threads must be at least 1, and params non-negative")
    return s


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident size (Linux >= 4.0); False where that is not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _trim() -> None:
    """Hand the heap's free memory back to the system (glibc), so that the resident size before a
    call does not include freed pages the call would reuse unseen."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def template(s: Settings) -> dict[str, torch.Tensor]:
    """The global model's state: a real model's, or synthetic tensors of `params` values in all."""
    if s.params:
        n = s.params
        sizes = [n * 6 // 10, n * 3 // 10]
        sizes.append(n - sum(sizes))
        gen = torch.Generator().manual_seed(0)
        return {f"layer{i}.weight": 0.05 * torch.randn(size, generator=gen) for i, size in enumerate(sizes) if size}
    from fedmq.fedcore.models import build_model

    options: dict[str, Any] = {"norm": "gn"} if s.model.startswith("resnet") else {}
    model = build_model(s.model, s.input_shape, 10, seed=0, **options)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def updates(state: dict[str, torch.Tensor], k: int, noise: float) -> list[dict[str, torch.Tensor]]:
    """K copies of `state`, each floating tensor plus `noise` x its std x (log-normal - its mean),
    one seeded stream per client: a right-skewed spread of every parameter across clients."""
    shift = math.exp(0.5)  # the mean of exp(N(0, 1))
    out = []
    for client in range(k):
        gen = torch.Generator().manual_seed(1000 + client)
        copy = {}
        for name, value in state.items():
            if value.is_floating_point():
                scale = noise * (float(value.std()) if value.numel() > 1 and float(value.std()) > 0 else 1.0)
                copy[name] = value + scale * (torch.randn(value.shape, generator=gen).exp_() - shift)
            else:
                copy[name] = value.clone()
        out.append(copy)
    return out


def worker(rule: str, k: int, s: Settings) -> dict[str, Any]:
    """One rule at one K in this process: the time per call and the peak memory above the inputs."""
    from fedmq.fedcore.aggregation import skew_aware, weighted_average

    torch.set_num_threads(s.threads)
    device = torch.device(s.device)
    states = updates(template(s), k, s.noise)
    weights = [float(100 + 10 * i) for i in range(k)]
    hp = skew_aware.SkewAwareOptions(c_mic=s.c_mic, s_mac=s.s_mac, cv_clip_quantile=s.cv_clip_quantile)
    aggregate = skew_aware.aggregator(hp, device=device if device.type != "cpu" else None)

    def call() -> dict[str, torch.Tensor]:
        if rule == "mean":
            if device.type == "cpu":
                return weighted_average(states, weights)
            moved = [{n: t.to(device) for n, t in one.items()} for one in states]  # the mean on the device, for parity
            return {n: t.cpu() for n, t in weighted_average(moved, weights).items()}
        return aggregate(states, weights)

    cuda = device.type == "cuda"
    if cuda:
        call()  # warm-up: CUDA context and kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        device_base = torch.cuda.memory_allocated()
    _trim()
    reset = _reset_peak()
    baseline = self_status("VmRSS")
    seconds = []
    for _ in range(s.repeats):
        started = time.perf_counter()
        result = call()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        del result
    peak_rss = self_status("VmHWM") - baseline if reset else None
    metrics = aggregate.metrics if rule == "sa" else {}
    return {
        "rule": rule,
        "updates": k,
        "params": sum(t.numel() for t in states[0].values()),
        "tensors": len(states[0]),
        "seconds_mean": sum(seconds) / len(seconds),
        "seconds": seconds,
        "peak_extra_rss_bytes": peak_rss,
        "peak_extra_device_bytes": torch.cuda.max_memory_allocated() - device_base if cuda else None,
        "input_bytes": sum(t.numel() * t.element_size() for one in states for t in one.values()),
        **metrics,
    }


def run_worker(rule: str, k: int, s: Settings) -> dict[str, Any]:
    """`worker` in a fresh process of its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=_CTX) as pool:
        return pool.submit(worker, rule, k, s).result()


def run(options: BenchOptions) -> Report:
    s = settings(options)
    results = [run_worker(rule, k, s) for k in s.updates for rule in RULES]
    return report(results, s)


def report(results: list[dict[str, Any]], s: Settings) -> Report:
    """The figures, one section per K: both rules' time and extra memory, SA's as a multiple of the
    mean's, and SA's statistics."""
    first = results[0]
    on_device = first["peak_extra_device_bytes"] is not None
    memory = "peak_extra_device_bytes" if on_device else "peak_extra_rss_bytes"
    out = Report(
        "fedsa",
        TITLE,
        context={
            "model": f"{s.params:,} synthetic values" if s.params else f"{s.model} (GroupNorm)",
            "parameters": f"{first['params']:,} in {first['tensors']} tensors",
            "device": s.device,
            "threads": s.threads,
            "C_mic, S_mac": f"{s.c_mic}, {s.s_mac}",
            "repeats": s.repeats,
            "statistic": "mean time of a call",
            "memory": "peak of the CUDA allocator" if on_device else "peak resident memory above the inputs",
        },
    )
    by_k: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_k.setdefault(r["updates"], {})[r["rule"]] = r
    for k, pair in sorted(by_k.items()):
        mean, sa = pair["mean"], pair["sa"]
        section = f"K = {k} updates held ({sa['input_bytes'] / MIB:.1f} MiB)"
        out.add("weighted mean (the reference)", mean["seconds_mean"] * 1e3, "ms", section=section,
                note=f"{_mib(mean[memory])} extra memory")  # fmt: skip
        out.add(
            "**FedSA's skew-aware average**", sa["seconds_mean"] * 1e3, "ms", section=section,
            ratio=sa["seconds_mean"] / mean["seconds_mean"] if mean["seconds_mean"] > 0 else math.inf,
            ratio_means="the weighted mean's time",
            note=f"{_mib(sa[memory])} extra memory; high-dispersion share {sa['sa_high_share']:.2e},"
            f" {sa['sa_clusters_mean']:.2f} clusters and {sa['sa_unclustered_mean']:.2f} unclustered per tensor",
        )  # fmt: skip
    out.context["results"] = {f"{r['rule']}-{r['updates']}": r for r in results}
    return out


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:.1f} MiB"
