"""The operators and memory traffic of each method's vectorised step, counted in a short run of the method.

`fedmq bench sim` counts FedAvg's, KDIA's and the norm layers' steps on synthetic workloads. A method's
own objective (FedProx's proximal term, MOON's contrastive term, FedACD's log Delta and Mixup) adds to
the step it trains with; this counts what, in a short run of an experiment file as `fedmq simulate` runs
it (`simulation.vectorize: true`, one local epoch, half the nodes a round; a frozen model's outputs made
before the steps, `simulation.outputs_ahead: true`, as a GPU makes them): the last step of the last
round's vectorised node training, which trains the nodes still training then, for each method given and
FedAvg in the same run's setting. So the counts compare within one file, not across files. Counted on
any device (`step_cost.StepCounter`); an operator is about one GPU kernel (`step_cost`'s docstring).

    python -m fedmq.experiments.bench.method_steps experiments/papers/fedacd.yaml fedprox fedacd
    python -m fedmq.experiments.bench.method_steps experiments/papers/kdia-beta01.yaml 'moon:{mu: 5.0}'

The data are the experiment's own (``FEDMQ_DATA_ROOT`` for the papers' datasets).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fedmq.experiments.bench.step_cost import MB, StepCost, last_step_cost

ROUNDS = 2
"""Two rounds: the methods with a teacher, a previous model or a generator use it from the second."""


def short_run(config: Mapping[str, Any], method: Mapping[str, Any]) -> dict[str, Any]:
    """`config` cut to a short vectorised run of `method`: no grid, two rounds of one local epoch, half
    the nodes a round (at most 20 nodes), evaluated at the end only, a frozen model's outputs made before
    the steps as on a GPU."""
    raw = {k: v for k, v in config.items() if k not in ("grid", "report")}
    nodes = min(int(raw.get("nodes", 20)), 20)
    return raw | {
        "name": "method-steps",
        "nodes": nodes,
        "rounds": ROUNDS,
        "eval_every": ROUNDS,
        "method": dict(method),
        "train": {**raw.get("train", {}), "local_epochs": 1},
        "policy": {**raw.get("policy", {}), "fraction": 0.5},
        "simulation": {**raw.get("simulation", {}), "vectorize": True, "outputs_ahead": True},
    }


def method_step_cost(config: Mapping[str, Any], method: Mapping[str, Any], out: Path) -> StepCost:
    """The last step of the last vectorised round of `method`'s short run of `config` (`short_run`)."""
    import fedmq

    try:
        return last_step_cost(lambda: fedmq.simulate(short_run(config, method), out, progress=False))
    except RuntimeError as exc:
        raise RuntimeError(f"{method.get('name')}: {exc} (is it a method that trains in groups?)") from exc


def parse_method(text: str) -> dict[str, Any]:
    """``name`` or ``name:{yaml hyperparameters}`` as a config's ``method``."""
    name, _, hyperparams = text.partition(":")
    parsed = yaml.safe_load(hyperparams) if hyperparams else {}
    if not isinstance(parsed, dict):
        raise SystemExit(f"method_steps: {text!r}: the hyperparameters after ':' must be a YAML mapping")
    return {"name": name, "hyperparams": parsed}


def table(costs: Mapping[str, StepCost]) -> str:
    """A Markdown table of the counts, each method's beside FedAvg's (the first row)."""
    base = next(iter(costs.values()))
    lines = ["| method | operators a step | memory traffic a step | operators over FedAvg's |", "|---|---|---|---|"]
    for name, cost in costs.items():
        lines.append(f"| {name} | {cost.ops} | {cost.bytes / MB:.0f} MB | {cost.ops / base.ops:.2f}x |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedmq.experiments.bench.method_steps",
        description="Count the operators and memory traffic of each method's vectorised step, beside FedAvg's, "
        "in a short run of an experiment file (two rounds, one local epoch).",
    )
    parser.add_argument("experiment", type=Path, help="an experiment file, e.g. experiments/papers/fedacd.yaml")
    parser.add_argument("methods", nargs="+", help="method names, or name:{yaml hyperparameters}")
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(args.experiment.read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"cannot read {args.experiment}: {exc}")
    if not isinstance(config, dict):
        raise SystemExit(f"method_steps: {args.experiment} holds no experiment (a YAML mapping)")
    methods = {"fedavg": {"name": "fedavg"}} | {text: parse_method(text) for text in args.methods}
    with tempfile.TemporaryDirectory(prefix="fedmq-method-steps-") as tmp:
        costs = {name: method_step_cost(config, m, Path(tmp) / f"{i}") for i, (name, m) in enumerate(methods.items())}
    print(table(costs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
