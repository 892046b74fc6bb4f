"""KDIA's teacher at scale: the coordinator's memory and time per round with N registered nodes.

    python -m experiments.bench_teacher --nodes 10000 --fraction 0.01 --rounds 300

Drives KDIA's real coordinator half (its `aggregate`, the participation record, the model store)
with synthetic updates of a small model through the coordinator's own engine on the in-process
driver (`coordinator.engine.local`: the engine samples each round's cohort of C x N nodes and
records their participation; the half's `aggregate` alone is timed), one mode per child process
so that each mode's resident memory is its own: the peak RSS above the process's state before the
first round, the bytes of tensors the teacher holds, the time per round, and each approximate
teacher's largest elementwise distance from the exact one after the last round (with the bound the
mode reports). The generator is off (lambda_gen = 0): it does not depend on N. Nothing goes over
the bus: this measures the teacher, not the transport. The RSS growth includes the engine's own
per-round bookkeeping at N nodes: the participation record, and its JSON for each round's
checkpoint (about 6 MiB at 9,500 nodes seen, measured alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODES = {
    "exact": {"teacher_mode": "exact"},
    "exact-disk": {"teacher_mode": "exact", "store": "disk"},
    "windowed": {"teacher_mode": "windowed", "window_rounds": 30},
    "incremental-disk": {"teacher_mode": "incremental", "store": "disk", "resync_every": 0},
    "streaming": {"teacher_mode": "streaming"},
}


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def worker(mode: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One mode in this process: rounds of synthetic updates through KDIA's coordinator half, driven
    by the coordinator's engine (`SyncRounds` on the in-process driver: it samples each round's
    cohort, keeps the participation record and calls `aggregate`, as the daemon does)."""
    from coordinator.config import CoordinatorConfig, RoundPolicy
    from coordinator.engine import SyncRounds
    from coordinator.engine.local import LocalFederation, LocalNode
    from fedcore.algorithms import build_hyperparams, get_algorithm
    from fedcore.algorithms.base import NodeHalf, Payload, TaskInput
    from fedcore.data import TensorDataset
    from fedcore.models import build_model
    from fedcore.training import TrainSettings

    class SyntheticNode(NodeHalf):
        """Trains nothing: its update is the template model plus noise from the task's own stream (the
        driver's per node, round and attempt). It keeps no state, so one instance serves every node."""

        def __init__(self, template: dict[str, torch.Tensor]) -> None:
            super().__init__(None, node_id="synthetic")
            self.template = template

        def train(
            self, task: TaskInput, model: torch.nn.Module, data: TensorDataset, generator: torch.Generator
        ) -> Payload:
            state = {
                k: v + 0.05 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v
                for k, v in self.template.items()
            }
            return Payload(tensors={"model": state})

    torch.set_num_threads(1)
    spec = get_algorithm("kdia")
    options = dict(MODES[mode])
    store_dir = tempfile.mkdtemp(prefix="fedmq-bench-store-") if options.get("store") == "disk" else ""
    hp = build_hyperparams(spec, {"lambda_gen": 0.0, "teacher_log_every": 0, "store_dir": store_dir, **options})
    model = build_model(
        args.model, tuple(args.input_shape), 10, seed=0, **({"hidden": [64]} if args.model == "mlp" else {})
    )
    half = spec.coordinator(hp, model=model)
    rng = np.random.default_rng(0)
    sizes = rng.integers(100, 1000, size=args.nodes)
    template = {k: v.clone() for k, v in model.state_dict().items()}
    node = SyntheticNode(template)
    nodes = {f"node-{i:05d}": LocalNode(node, _sized(int(n))) for i, n in enumerate(sizes)}
    policy = RoundPolicy(fraction=args.fraction, min_nodes=args.nodes)
    config = CoordinatorConfig(federation="bench-teacher", rounds=args.rounds, policy=policy, train=TrainSettings())
    engine = SyncRounds(config, half.update_schema(), evaluates=False)
    fed = LocalFederation(engine=engine, half=half, nodes=nodes, workspace=torch.nn.Identity())
    seconds = []
    aggregate = half.aggregate

    def timed(*call: Any) -> Any:
        started = time.perf_counter()
        metrics = aggregate(*call)
        seconds.append(time.perf_counter() - started)
        return metrics

    half.aggregate = timed  # type: ignore[method-assign]
    baseline = _status("VmRSS")
    fed.run()
    if engine.state != "finished" or engine.rounds_completed != args.rounds:
        raise RuntimeError(f"the engine ended {engine.state} after {engine.rounds_completed} rounds: {engine.error}")
    metrics = fed.records[-1]
    held = half.state_dict()
    teacher = {k: v.clone() for k, v in half.teacher_model.state_dict().items()}
    torch.save(teacher, out)  # read back by the parent, which wrote nothing else there
    model_bytes = _tensor_bytes(template)
    store_bytes = _tensor_bytes({k: v for k, v in held.items() if k.startswith(("store/", "stream/"))})
    disk = sum(p.stat().st_size for p in Path(store_dir).glob("*")) if store_dir else 0
    return {
        "mode": mode,
        "options": options,
        "nodes": args.nodes,
        "per_round": len(metrics["selected"]),
        "rounds": args.rounds,
        "nodes_seen": sum(1 for n in engine.participation if n.count > 0),
        "model_bytes": model_bytes,
        "teacher_tensor_bytes_in_memory": store_bytes,
        "store_bytes_on_disk": disk,
        "rss_growth_bytes": _status("VmHWM") - baseline,
        "seconds_per_round_mean": float(np.mean(seconds)),
        "seconds_per_round_last10": float(np.mean(seconds[-10:])),
        "models_held": metrics["teacher_models_held"],
        "error_share": metrics["teacher_error_share"],
    }


def _sized(n: int) -> Any:
    """A dataset of `n` samples that holds nothing: a node's data only tells the driver its size."""
    from fedcore.data import TensorDataset

    return TensorDataset(torch.zeros(1, 0).expand(n, 0), torch.zeros(1, dtype=torch.long).expand(n), 10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_teacher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000, help="registered nodes (default 10000)")
    parser.add_argument("--fraction", type=float, default=0.01, help="fraction C taking part each round (default 0.01)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds (default 300: about 95%% of the nodes seen)")
    parser.add_argument("--model", default="mlp", help="a model of fedcore.models (default mlp 64-64-10)")
    parser.add_argument("--input-shape", type=int, nargs="+", default=[64])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args, args.worker_out)))
        return 0
    if args.nodes < 1 or args.rounds < 1 or not 0 < args.fraction <= 1:
        parser.error("--nodes and --rounds must be at least 1, and --fraction in (0, 1]")
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    results, teachers = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out = Path(tmp) / f"{mode}.pt"
            command = [sys.executable, "-m", "experiments.bench_teacher", "--worker", mode, "--worker-out", str(out)]
            command += ["--nodes", str(args.nodes), "--fraction", str(args.fraction), "--rounds", str(args.rounds)]
            command += ["--model", args.model, "--input-shape", *map(str, args.input_shape)]
            print(f"{mode}: {args.rounds} rounds, {args.nodes} nodes ...", file=sys.stderr, flush=True)
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            teachers[mode] = torch.load(out, weights_only=True)
    if "exact" in teachers:
        exact = teachers["exact"]
        spread = max(float((exact[k].float()).abs().max()) for k in exact if exact[k].is_floating_point())
        for r in results:
            theirs = teachers[r["mode"]]
            r["max_abs_diff_from_exact"] = max(
                float((theirs[k].double() - exact[k].double()).abs().max())
                for k in exact
                if exact[k].is_floating_point()
            )
            r["exact_teacher_max_abs"] = spread
    _print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _print_table(results: list[dict[str, Any]]) -> None:
    exact = next((r for r in results if r["mode"] == "exact"), None)
    print(
        "| mode | models held | tensors in memory | on disk | RSS growth | vs exact | s/round"
        " | max abs diff from exact | error share |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ratio = (
            f"{r['rss_growth_bytes'] / exact['rss_growth_bytes']:.3f}" if exact and exact["rss_growth_bytes"] else "n/a"
        )
        diff = r.get("max_abs_diff_from_exact")
        print(
            f"| {r['mode']} | {r['models_held']:.0f} | {r['teacher_tensor_bytes_in_memory'] / 2**20:.1f} MiB"
            f" | {r['store_bytes_on_disk'] / 2**20:.1f} MiB | {r['rss_growth_bytes'] / 2**20:.1f} MiB | {ratio}"
            f" | {r['seconds_per_round_mean'] * 1000:.1f} ms | {'n/a' if diff is None else f'{diff:.2e}'}"
            f" | {r['error_share']:.2e} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
