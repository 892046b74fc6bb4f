"""Where a simulation's wall time went (`wall_seconds_by_part` in its summary, and a grid's line per
cell): the nodes' training, the coordinator's aggregation, evaluation and checkpoints, and the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.report import time_shares
from fedmq.experiments.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: as the node hosts train
ROOT = Path(__file__).resolve().parents[2]


def test_the_summary_splits_the_wall_time_into_training_the_coordinator_s_parts_and_the_rest(
    tmp_path: Path,
) -> None:
    """KDIA (its aggregation trains the generator), checkpointed every round: every part took time, the
    training part is the summary's `train_seconds`, and the parts add up to the wall time."""
    overrides = ["rounds=2", "method.name=kdia", "simulation.checkpoint_every=1"]
    overrides += ["method.hyperparams={gen_epochs: 1, gen_batches_per_epoch: 5}"]  # a cheap generator
    cfg = parse_config(apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), overrides))
    summary = simulate(cfg, tmp_path / "run", device=torch.device("cpu"))
    parts = summary["wall_seconds_by_part"]
    assert list(parts) == ["training", "aggregation", "evaluation", "checkpoints", "other"]
    assert parts["training"] == summary["train_seconds"]
    assert all(parts[name] > 0 for name in ("training", "aggregation", "evaluation", "checkpoints"))
    assert parts["other"] >= 0
    assert sum(parts.values()) == pytest.approx(summary["wall_seconds"], abs=0.005)  # each part rounded to 1 ms


def test_a_run_s_parts_read_as_shares_of_its_wall_time_largest_first() -> None:
    """As a grid's line for a finished cell and the report's table of cells give them."""
    summary = {"wall_seconds": 10.0, "wall_seconds_by_part": {"training": 6.0, "evaluation": 3.0, "other": 1.0}}
    assert time_shares(summary) == "60% training, 30% evaluation, 10% other"
    assert time_shares({"wall_seconds": 10.0}) == ""  # a summary from before the parts, or a failed cell's
    assert time_shares({"wall_seconds": 0.0, "wall_seconds_by_part": {"training": 0.0}}) == ""


def test_sparse_evaluations_with_the_last_rounds_each_evaluated_keep_a_last_k_metric_exact(tmp_path: Path) -> None:
    """`eval_every` 10 with `eval_last` 2 over 5 rounds: only the last two are evaluated, so FedSA's
    kind of metric (the mean of the last K rounds' accuracies) reads the same rounds as when every round
    is evaluated, at a fraction of the evaluations."""
    from fedmq.experiments.grid import ReportConfig
    from fedmq.experiments.report import load_cell

    cfg = read_yaml(ROOT / "experiments" / "quickstart.yaml")
    runs = {}
    for name, overrides in {"every": ["eval_every=1"], "sparse": ["eval_every=10", "eval_last=2"]}.items():
        parsed = parse_config(apply_overrides(cfg, ["rounds=5", *overrides]))
        simulate(parsed, tmp_path / name, device=torch.device("cpu"))
        runs[name] = load_cell(tmp_path / name, name, {}, "fedavg")
    assert [r for r, _ in runs["every"].curve] == [0, 1, 2, 3, 4]  # 0-based rounds
    assert runs["sparse"].curve == runs["every"].curve[-2:]  # the same model at the same rounds
    last_two = ReportConfig(paper_metric="last_mean", last_k=2)
    assert runs["sparse"].metric("last_mean", last_two) == runs["every"].metric("last_mean", last_two)
