"""KDIA's teacher at scale: the coordinator's memory and time per round with N registered nodes.

Drives KDIA's real coordinator half (its `aggregate`, the participation record, the model store)
with synthetic updates of a small model through the coordinator's own engine on the in-process
driver (`coordinator.drivers.local`: the engine samples each round's cohort of C x N nodes and
records their participation; the half's `aggregate` alone is timed), one mode per fresh child
process so that each mode's resident memory is its own: the peak RSS above the process's state
before the first round, the bytes of tensors the teacher holds, the time per round, and each
approximate teacher's largest elementwise distance from the exact one after the last round (with
the bound the mode reports). Each mode's memory and time are reported as multiples of the exact
teacher's, measured in the same run. The generator is off (lambda_gen = 0): it does not depend on
N. Nothing goes over the bus: this measures the teacher, not the transport. The RSS growth
includes the engine's own per-round bookkeeping at N nodes: the participation record, and its
JSON for each round's checkpoint (about 6 MiB at 9,500 nodes seen, measured alone).

Settings (``--opt key=value``): ``nodes`` (10000), ``fraction`` (0.01), ``rounds`` (300: about
95% of the nodes seen), ``model`` (mlp 64-64-10), ``input_shape`` (64), ``modes`` (exact,
exact-disk, windowed, incremental-disk, streaming).
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedmq.experiments.bench.common import MIB, BenchOptions, Report
from fedmq.experiments.bench.procs import self_status
from fedmq.fedcore.errors import ConfigError

TITLE = "KDIA's teacher modes with N registered nodes: memory and time a round against the exact teacher"

MODES: dict[str, dict[str, Any]] = {
    "exact": {"teacher_mode": "exact"},
    "exact-disk": {"teacher_mode": "exact", "store": "disk"},
    "windowed": {"teacher_mode": "windowed", "window_rounds": 30},
    "incremental-disk": {"teacher_mode": "incremental", "store": "disk", "resync_every": 0},
    "streaming": {"teacher_mode": "streaming"},
}
"""Each mode's KDIA hyperparameters."""

_CTX = mp.get_context("spawn")  # each mode in a fresh process: its memory is its own


@dataclass(frozen=True, slots=True)
class Settings:
    """The suite's settings; each can be set with ``--opt key=value`` (lists: comma-separated)."""

    nodes: int = 10_000
    """Registered nodes."""
    fraction: float = 0.01
    """Fraction C taking part each round."""
    rounds: int = 300
    """Rounds (300 at C = 0.01: about 95% of the nodes seen)."""
    model: str = "mlp"
    """A model of fedcore.models (the MLP with one hidden layer of 64)."""
    input_shape: tuple[int, ...] = (64,)
    modes: tuple[str, ...] = tuple(MODES)


QUICK = Settings(nodes=60, fraction=0.1, rounds=12, modes=("exact", "windowed", "streaming"))
"""--quick: 60 nodes, 12 rounds (inside the 30-round window): checks that it all runs."""


def settings(options: BenchOptions) -> Settings:
    base = QUICK if options.quick else Settings()
    changes: dict[str, Any] = {}
    for key, value in options.extra.items():
        if key not in {f.name for f in fields(Settings)}:
            raise ConfigError(f"--opt {key}: unknown setting; see experiments/bench/teacher.py")
        items = [x for x in str(value).split(",") if x]
        try:
            if key == "modes":
                changes[key] = tuple(items)
            elif key == "input_shape":
                changes[key] = tuple(int(x) for x in items)
            else:
                changes[key] = type(getattr(base, key))(value)
        except ValueError:
            raise ConfigError(f"--opt {key}={value!r}: expected a {type(getattr(base, key)).__name__}") from None
    s = replace(base, **changes)
    unknown = sorted(set(s.modes) - set(MODES))
    if unknown:
        raise ConfigError(f"--opt modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if s.nodes < 1 or s.rounds < 1 or not 0 < s.fraction <= 1 or not s.modes:
        raise ConfigError("nodes and rounds must be at least 1, fraction in (0, 1], and modes not empty")
    return s


def _tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def worker(mode: str, s: Settings, out: Path) -> dict[str, Any]:
    """One mode in this process: rounds of synthetic updates through KDIA's coordinator half, driven
    by the coordinator's engine (`SyncRounds` on the in-process driver: it samples each round's
    cohort, keeps the participation record and calls `aggregate`, as the daemon does). The teacher
    is saved to `out` for the parent to compare with the exact one."""
    from fedmq.coordinator.config import CoordinatorConfig, RoundPolicy
    from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
    from fedmq.coordinator.engine import SyncRounds
    from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
    from fedmq.fedcore.algorithms.base import NodeHalf, Payload, TaskInput
    from fedmq.fedcore.data import TensorDataset
    from fedmq.fedcore.models import build_model
    from fedmq.fedcore.training import TrainSettings

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
    model = build_model(s.model, s.input_shape, 10, seed=0, **({"hidden": [64]} if s.model == "mlp" else {}))
    half = spec.coordinator(hp, model=model)
    rng = np.random.default_rng(0)
    sizes = rng.integers(100, 1000, size=s.nodes)
    template = {k: v.clone() for k, v in model.state_dict().items()}
    node = SyntheticNode(template)
    nodes = {f"node-{i:05d}": LocalNode(node, _sized(int(n))) for i, n in enumerate(sizes)}
    policy = RoundPolicy(fraction=s.fraction, min_nodes=s.nodes)
    config = CoordinatorConfig(federation="bench-teacher", rounds=s.rounds, policy=policy, train=TrainSettings())
    engine = SyncRounds(config, half.update_schema(), evaluates=False)
    fed = LocalFederation(engine=engine, half=half, nodes=nodes, workspace=torch.nn.Identity())
    seconds = []
    aggregate = half.aggregate

    def timed(*call: Any) -> Any:
        started = time.perf_counter()
        metrics = aggregate(*call)
        seconds.append(time.perf_counter() - started)
        return metrics

    half.aggregate = timed  # type: ignore[method-assign,assignment]
    baseline = self_status("VmRSS")
    fed.run()
    if engine.state != "finished" or engine.rounds_completed != s.rounds:
        raise RuntimeError(f"the engine ended {engine.state} after {engine.rounds_completed} rounds: {engine.error}")
    metrics = fed.records[-1]
    held = half.state_dict()
    teacher = {k: v.clone() for k, v in half.teacher_model.state_dict().items()}  # type: ignore[attr-defined]
    torch.save(teacher, out)  # read back by the parent (weights_only), which wrote nothing else there
    store_bytes = _tensor_bytes({k: v for k, v in held.items() if k.startswith(("store/", "stream/"))})
    return {
        "mode": mode,
        "options": options,
        "nodes": s.nodes,
        "per_round": len(metrics["selected"]),
        "rounds": s.rounds,
        "nodes_seen": sum(1 for n in engine.participation if n.count > 0),
        "model_params": sum(t.numel() for t in template.values()),
        "model_bytes": _tensor_bytes(template),
        "teacher_tensor_bytes_in_memory": store_bytes,
        "store_bytes_on_disk": sum(p.stat().st_size for p in Path(store_dir).glob("*")) if store_dir else 0,
        "rss_growth_bytes": self_status("VmHWM") - baseline,
        "seconds_per_round_mean": float(np.mean(seconds)),
        "seconds_per_round_last10": float(np.mean(seconds[-10:])),
        "models_held": metrics["teacher_models_held"],
        "error_share": metrics["teacher_error_share"],
    }


def _sized(n: int) -> Any:
    """A dataset of `n` samples that holds nothing: a node's data only tells the driver its size."""
    from fedmq.fedcore.data import TensorDataset

    return TensorDataset(torch.zeros(1, 0).expand(n, 0), torch.zeros(1, dtype=torch.long).expand(n), 10)


def run(options: BenchOptions) -> Report:
    s = settings(options)
    results, teachers = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in s.modes:
            out = Path(tmp) / f"{mode}.pt"
            with ProcessPoolExecutor(max_workers=1, mp_context=_CTX) as pool:
                results.append(pool.submit(worker, mode, s, out).result())
            teachers[mode] = torch.load(out, weights_only=True)
    if "exact" in teachers:
        exact = teachers["exact"]
        spread = max(float(exact[k].float().abs().max()) for k in exact if exact[k].is_floating_point())
        for r in results:
            theirs = teachers[r["mode"]]
            r["max_abs_diff_from_exact"] = max(
                float((theirs[k].double() - exact[k].double()).abs().max())
                for k in exact
                if exact[k].is_floating_point()
            )
            r["exact_teacher_max_abs"] = spread
    return report(results, s)


def report(results: list[dict[str, Any]], s: Settings) -> Report:
    """Two sections, one row per mode: the memory growth and the time a round, each with its ratio
    to the exact teacher's (when the exact mode ran), the teacher's distance from the exact one
    and the error share it reports beside them."""
    first = results[0]
    out = Report(
        "teacher",
        TITLE,
        context={
            "nodes": f"{s.nodes:,}",
            "C": f"{s.fraction:g} ({first['per_round']} a round)",
            "rounds": s.rounds,
            "nodes seen": f"{first['nodes_seen']:,}",
            "model": f"{s.model} ({first['model_params']:,} parameters, {first['model_bytes'] / 1e3:.0f} KB)",
            "statistic": "peak RSS above the state before the first round; mean time of the half's aggregate",
        },
    )
    exact = next((r for r in results if r["mode"] == "exact"), None)

    def ratio(r: dict[str, Any], key: str) -> dict[str, Any]:
        if exact is None or not exact[key]:
            return {}
        return {"ratio": r[key] / exact[key], "ratio_means": "the exact teacher's"}

    for r in results:
        disk = f", {r['store_bytes_on_disk'] / MIB:.1f} MiB on disk" if r["store_bytes_on_disk"] else ""
        out.add(
            r["mode"], r["rss_growth_bytes"] / MIB, "MiB", section="resident memory growth",
            note=f"{r['models_held']:,.0f} models held, {r['teacher_tensor_bytes_in_memory'] / MIB:.1f} MiB of"
            f" tensors in memory{disk}",
            **ratio(r, "rss_growth_bytes"),
        )  # fmt: skip
    for r in results:
        diff = r.get("max_abs_diff_from_exact")
        out.add(
            r["mode"], r["seconds_per_round_mean"] * 1e3, "ms", section="time a round (the half's aggregate)",
            note=f"max abs diff from exact {'n/a' if diff is None else f'{diff:.1e}'},"
            f" error share {r['error_share']:.1e}",
            **ratio(r, "seconds_per_round_mean"),
        )  # fmt: skip
    out.context["results"] = {r["mode"]: r for r in results}
    return out
