"""FedSA's aggregation cost: SA against the weighted mean as the number of updates held grows.

    python -m experiments.bench_fedsa                      # ResNet-18 (GroupNorm), K = 5, 10, 20, 50
    python -m experiments.bench_fedsa --params 1000000 --updates 5,20,100 --json sa.json

The issue: "Its cost grows with the number of updates held at once: measure it, and keep it
vectorised". For each K, K synthetic updates (the global model plus seeded per-client noise with a
right-skewed, log-normal distribution, so that the cross-client distribution of each parameter is
skewed as the paper describes) go through `fedcore.aggregation.weighted_average` and through
`fedcore.algorithms.fedsa.skew_aware_average`, each in its own child process so that each figure
is its own: the mean time of a call (after one untimed warm-up call on CUDA) and the peak memory
above what the K updates already take (resident memory on the CPU, the peak of the CUDA allocator
on a GPU). The table also gives SA's share of high-dispersion parameters and its mean number of
clusters per clustered tensor. Nothing goes over the bus and nothing trains: this measures the rule.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RULES = ("mean", "sa")


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


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


def template(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The global model's state: a real model's, or synthetic tensors of `--params` values in all."""
    if args.params:
        n = args.params
        sizes = [n * 6 // 10, n * 3 // 10]
        sizes.append(n - sum(sizes))
        gen = torch.Generator().manual_seed(0)
        return {f"layer{i}.weight": 0.05 * torch.randn(size, generator=gen) for i, size in enumerate(sizes) if size}
    from fedcore.models import build_model

    options: dict[str, Any] = {"norm": "gn"} if args.model.startswith("resnet") else {}
    model = build_model(args.model, tuple(args.input_shape), 10, seed=0, **options)
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


def worker(rule: str, k: int, args: argparse.Namespace) -> dict[str, Any]:
    """One rule at one K in this process: the time per call and the peak memory above the inputs."""
    from fedcore.aggregation import weighted_average
    from fedcore.algorithms import fedsa

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    states = updates(template(args), k, args.noise)
    weights = [float(100 + 10 * i) for i in range(k)]
    hp = fedsa.Hyperparams(c_mic=args.c_mic, s_mac=args.s_mac, cv_clip_quantile=args.cv_clip_quantile)
    aggregate = fedsa.aggregator(hp, device=device if device.type != "cpu" else None)

    def call() -> dict[str, torch.Tensor]:
        if rule == "mean":
            if device.type == "cpu":
                return weighted_average(states, weights)
            moved = [{n: t.to(device) for n, t in s.items()} for s in states]  # the mean on the device, for parity
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
    baseline = _status("VmRSS")
    seconds = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        result = call()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        del result
    peak_rss = _status("VmHWM") - baseline if reset else None
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
        "input_bytes": sum(t.numel() * t.element_size() for s in states for t in s.values()),
        **metrics,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_fedsa", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet18", help="a model of fedcore.models (default resnet18, GroupNorm)")
    parser.add_argument("--input-shape", type=int, nargs="+", default=[3, 32, 32])
    parser.add_argument("--params", type=int, default=0, help="synthetic tensors of this many values instead")
    parser.add_argument("--updates", default="5,10,20,50", help="comma-separated K (default 5,10,20,50)")
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per K and rule (default 2)")
    parser.add_argument("--c-mic", type=int, default=4, help="FedSA's C_mic (default 4, CIFAR-10)")
    parser.add_argument("--s-mac", type=int, default=4, help="FedSA's S_mac (default 4, CIFAR-10)")
    parser.add_argument("--cv-clip-quantile", type=float, default=1.0, help="FedSA's robust CV clip (default 1)")
    parser.add_argument("--noise", type=float, default=0.05, help="client noise, in units of each tensor's std")
    parser.add_argument("--device", default="cpu", help="where the rules compute (cpu, cuda)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=RULES, help=argparse.SUPPRESS)
    parser.add_argument("--worker-k", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.worker_k, args)))
        return 0
    try:
        ks = [int(x) for x in args.updates.split(",") if x]
    except ValueError:
        parser.error(f"--updates must be comma-separated integers, got {args.updates!r}")
    if not ks or min(ks) < 1 or args.repeats < 1 or args.params < 0 or args.threads < 1:
        parser.error("--updates, --repeats and --threads must be at least 1, and --params non-negative")
    passed = ["--model", args.model, "--input-shape", *map(str, args.input_shape), "--params", str(args.params)]
    passed += ["--repeats", str(args.repeats), "--c-mic", str(args.c_mic), "--s-mac", str(args.s_mac)]
    passed += ["--cv-clip-quantile", str(args.cv_clip_quantile), "--noise", str(args.noise)]
    passed += ["--device", args.device, "--threads", str(args.threads)]
    results = []
    for k in ks:
        for rule in RULES:
            print(f"{rule}: K = {k} ...", file=sys.stderr, flush=True)
            command = [sys.executable, "-m", "experiments.bench_fedsa", "--worker", rule, "--worker-k", str(k), *passed]
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = table(results)
    print(f"{results[0]['params']:,} parameters in {results[0]['tensors']} tensors, device {args.device}")
    print(rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def table(results: list[dict[str, Any]]) -> str:
    """The markdown table, one row per K: both rules' time and extra memory, their ratio, SA's statistics."""
    by_k: dict[int, dict[str, dict[str, Any]]] = {}
    for r in results:
        by_k.setdefault(r["updates"], {})[r["rule"]] = r
    memory = "peak_extra_device_bytes" if results[0]["peak_extra_device_bytes"] is not None else "peak_extra_rss_bytes"
    lines = [
        "| K | updates held | mean time | SA time | SA / mean | mean extra memory | SA extra memory"
        " | high-dispersion share | clusters per tensor | unclustered per tensor |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k, pair in sorted(by_k.items()):
        mean, sa = pair["mean"], pair["sa"]
        ratio = sa["seconds_mean"] / mean["seconds_mean"] if mean["seconds_mean"] > 0 else math.inf
        lines.append(
            f"| {k} | {_mib(sa['input_bytes'])} | {mean['seconds_mean'] * 1000:.1f} ms"
            f" | {sa['seconds_mean'] * 1000:.1f} ms | {ratio:.1f} | {_mib(mean[memory])} | {_mib(sa[memory])}"
            f" | {sa['sa_high_share']:.2e}"
            f" | {sa['sa_clusters_mean']:.2f} | {sa['sa_unclustered_mean']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
