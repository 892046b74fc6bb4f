"""Central DP in `fedmq simulate` and `fedmq replay` (issue 32, item 3): the quickstart with DP-FedAvg
reports its epsilon in every round's line and in the summary, stops at a target epsilon, and replays
bit for bit from its seeds (each round's noise is the round's own stream); the noise is really there
(less noise ends on another model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.replay import replay_run
from fedmq.experiments.simulate import simulate

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
CENTRAL = ["privacy.mechanism=central", "privacy.noise_multiplier=1.0", "privacy.clip_norm=2.0", "train.local_epochs=1"]


def _run(out: Path, *overrides: str) -> tuple[list[dict], dict]:
    data = apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), [*CENTRAL, *overrides])
    simulate(parse_config(data), out, device=torch.device("cpu"))
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return lines, json.loads((out / "summary.json").read_text())


def test_a_private_simulation_reports_its_epsilon_stops_at_the_target_and_replays(tmp_path: Path) -> None:
    lines, summary = _run(tmp_path / "run", "rounds=40", "privacy.target_epsilon=3")
    cfg = parse_config(apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), CENTRAL))
    central = cfg.privacy.central(cfg.nodes, cfg.fraction, cfg.seed)
    assert central is not None
    rounds = central.rounds_within(3.0)
    assert len(lines) == rounds < 40  # cut at the target
    assert [line["dp_epsilon"] for line in lines] == [central.epsilon(r + 1) for r in range(rounds)]
    privacy = summary["privacy"]
    assert privacy["epsilon"] == central.epsilon(rounds) <= 3.0 and privacy["delta"] == central.delta == 0.005
    outcome = replay_run(tmp_path / "run")
    assert outcome.ok and outcome.report.final_model_sha256 == summary["model_sha256"]
    rounds_only = f"rounds={rounds}"
    _, again = _run(tmp_path / "again", rounds_only)  # the same rounds without a target: the same run
    _, quieter = _run(tmp_path / "quieter", rounds_only, "privacy.noise_multiplier=0.001")
    assert again["model_sha256"] == summary["model_sha256"] != quieter["model_sha256"]


def test_a_simulation_with_dp_sgd_on_every_node_reports_each_nodes_epsilon_and_replays(tmp_path: Path) -> None:
    from fedmq.experiments.build import train_settings
    from fedmq.fedcore.privacy import node_epsilon

    node = ["privacy.mechanism=node", "privacy.noise_multiplier=1.0", "privacy.clip_norm=1.0", "rounds=2"]
    data = apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), ["train.local_epochs=1", *node])
    cfg = parse_config(data)
    simulate(cfg, tmp_path / "run", device=torch.device("cpu"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    participation = json.loads((tmp_path / "run" / "participation.json").read_text())
    settings = train_settings(cfg)  # the experiment's, with DP-SGD's noise and per-sample clip
    assert (settings.dp_noise_multiplier, settings.max_grad_norm) == (1.0, 1.0)
    expected = {
        n: node_epsilon(settings, p["num_samples"], max(p["rounds_selected"], p["count"]), 0.005)
        for n, p in participation.items()
    }
    assert summary["privacy"]["epsilon_by_node"] == expected and summary["privacy"]["mechanism"] == "node"
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["node_dp_epsilon_max"] == max(expected.values()) > 0
    assert replay_run(tmp_path / "run").ok
