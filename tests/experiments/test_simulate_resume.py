"""`fedmq simulate --resume` (issue 28, item 4): a simulated run cut off after a checkpoint and resumed
ends as the same run never cut, bit for bit (final model, metrics lines, summary, participation),
for a stateless method, for stateful ones (SCAFFOLD's control variates, MOON's previous model) and
under a churning scenario; a finished run or grid cell is never run again; what cannot be resumed
exactly is refused with a message saying what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import fedmq.experiments.simulate as simulate_module
from fedmq.coordinator.drivers.replay import ReplayError
from fedmq.coordinator.storage.run_dir import CHECKPOINT
from fedmq.experiments.cli import EXIT_CONFIG, EXIT_OK, main
from fedmq.experiments.config import ExperimentConfig, apply_overrides, parse_config, read_yaml
from fedmq.experiments.grid import expand
from fedmq.experiments.replay import replay_run
from fedmq.experiments.scenario import resolve_scenario
from fedmq.experiments.sim_checkpoint import ResumeError
from fedmq.experiments.simulate import simulate

pytestmark = [
    pytest.mark.usefixtures("one_thread"),  # conftest: sums in one order, bit for bit
    pytest.mark.timed,  # the command line in a subprocess, with a timeout: never in the compute lane
]
ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
FAST = ["rounds=6", "train.local_epochs=1", "simulation.checkpoint_every=2"]
"""Checkpoints after rounds 1, 3 and 5 (0-based); the cut comes at round 3's, so the run resumes
from round 1's with the lines of rounds 2 and 3 already written."""


class Cut(Exception):
    """The process dies here."""


def _config(*overrides: str, scenario: str | None = None) -> ExperimentConfig:
    data = apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), [*FAST, *overrides])
    if scenario is not None:
        data["scenario"] = resolve_scenario(scenario, ROOT / "experiments" / "scenarios")
    return parse_config(data)


def _cut_at(monkeypatch: pytest.MonkeyPatch, round: int) -> None:
    """Kill the run as it is about to write the checkpoint of `round`: the checkpoint before it stays."""
    real = simulate_module.save

    def save(run_dir: Any, fed: Any, command: Any, moment: Any) -> None:
        if command.key >= round:
            raise Cut(f"killed at round {command.key}")
        real(run_dir, fed, command, moment)

    monkeypatch.setattr(simulate_module, "save", save)


def _cut_run(cfg: ExperimentConfig, out: Path, monkeypatch: pytest.MonkeyPatch, round: int = 3) -> None:
    with monkeypatch.context() as patch:
        _cut_at(patch, round)
        with pytest.raises(Cut):
            simulate(cfg, out, device=CPU)
    rounds = [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(rounds) >= 2  # the cut run went past its checkpoint: those lines must go on resume
    assert (out / CHECKPOINT).exists()


PROCESS_ONLY = {"resumed_from_round", "train_seconds", "train_share", "images_trained", "groups_trained"}
"""Summary fields about this process's own work (its training time, what it trained since it started)."""


def _outcome(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without what differs between any two runs (wall time) or belongs to one process."""
    return {k: v for k, v in summary.items() if "wall" not in k and k not in PROCESS_ONLY}


@pytest.mark.parametrize(
    ("method", "scenario", "overrides"),
    [
        ("fedavg", None, []),
        ("scaffold", None, []),
        ("moon", "churn.yaml", ["policy.min_nodes=5"]),  # nodes come and go, crash and drop tasks
        # central DP with adaptive clipping: each round's noise, and the clip norm the checkpoint carries
        (
            "fedavg",
            None,
            ["privacy.mechanism=central", "privacy.noise_multiplier=0.4", "privacy.adaptive_clipping=true"],
        ),
    ],
)
def test_a_run_cut_after_a_checkpoint_resumes_to_the_uncut_runs_model(
    method: str, scenario: str | None, overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(f"method.name={method}", *overrides, scenario=scenario)
    uncut = simulate(cfg, tmp_path / "uncut", device=CPU)
    assert uncut["state"] == "finished"
    cut = tmp_path / "cut"
    _cut_run(cfg, cut, monkeypatch)
    resumed = simulate(cfg, cut, device=CPU, resume=True)
    assert resumed["resumed_from_round"] == 1
    assert resumed["model_sha256"] == uncut["model_sha256"]
    assert (cut / "metrics.jsonl").read_text() == (tmp_path / "uncut" / "metrics.jsonl").read_text()
    assert _outcome(resumed) == _outcome(uncut)
    participation = [json.loads((d / "participation.json").read_text()) for d in (cut, tmp_path / "uncut")]
    assert participation[0] == participation[1]


def test_a_resumed_runs_event_log_continues_after_a_resume_line_and_replay_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config()
    simulate(cfg, tmp_path / "uncut", device=CPU)
    cut = tmp_path / "cut"
    _cut_run(cfg, cut, monkeypatch)
    simulate(cfg, cut, device=CPU, resume=True)
    lines = [json.loads(line) for line in (cut / "events.jsonl").read_text().splitlines()]
    uncut = [json.loads(line) for line in (tmp_path / "uncut" / "events.jsonl").read_text().splitlines()]
    marks = [i for i, line in enumerate(lines) if "resume" in line]
    assert len(marks) == 1
    assert lines[marks[0]]["resume"]["round"] == 1
    assert lines[1 : marks[0]] == uncut[1 : marks[0]]  # what the cut run logged, as the uncut run did
    assert lines[-1] == uncut[-1] == {"cmd": "Finish", "state": "finished", "error": ""}

    def tasks(part: list[dict[str, Any]]) -> list[list[Any]]:
        return [line["tasks"] for line in part if line.get("cmd") == "Configure"]

    # from the round after the checkpoint on, the same nodes got the same task ids as in the uncut run
    after = tasks(lines[marks[0] :])
    assert after == tasks(uncut)[-len(after) :] and len(after) == 4
    with pytest.raises(ReplayError, match="resumed from a checkpoint"):
        replay_run(cut)


def test_resume_without_a_checkpoint_starts_afresh_and_a_finished_run_is_not_run_again(tmp_path: Path) -> None:
    cfg = _config("rounds=3", "simulation.checkpoint_every=0")
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"round": 0, "stale": true}\n')  # a first try cut before any checkpoint
    first = simulate(cfg, out, device=CPU, resume=True)
    assert "resumed_from_round" not in first and not (out / CHECKPOINT).exists()
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = simulate(cfg, out, device=CPU, resume=True)
    assert again == json.loads((out / "summary.json").read_text())
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps  # nothing was run or written


def test_resume_refuses_the_async_engine_and_another_experiments_run_dir(tmp_path: Path) -> None:
    data = apply_overrides(read_yaml(ROOT / "experiments" / "quickstart-async.yaml"), ["engine.aggregations=4"])
    with pytest.raises(ResumeError, match=r"engine\.kind async always has tasks in flight"):
        simulate(parse_config(data), tmp_path / "async", device=CPU, resume=True)
    out = tmp_path / "run"
    simulate(_config("rounds=2"), out, device=CPU)
    with pytest.raises(ResumeError, match="made with another experiment"):
        simulate(_config("rounds=2", "seed=1"), out, device=CPU, resume=True)
    # how often a run checkpoints is no other experiment: a finished run stays finished
    assert simulate(_config("rounds=2", "simulation.checkpoint_every=1"), out, device=CPU, resume=True)["state"]
    assert main(["simulate", str(ROOT / "experiments" / "quickstart.yaml"), "--resume"]) == EXIT_CONFIG  # no --out


def test_a_node_state_a_checkpoint_cannot_hold_is_named() -> None:
    from fedmq.experiments.sim_checkpoint import decode_node_state, encode_node_state
    from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm

    spec = get_algorithm("scaffold")
    half = spec.node(build_hyperparams(spec, None), node_id="node-000")
    half.control = {"w": torch.arange(3.0)}  # type: ignore[attr-defined]
    half.kept = ([1, 2.5], None, "x")  # type: ignore[attr-defined]
    skeleton, tensors = encode_node_state(half)
    fresh = spec.node(build_hyperparams(spec, None), node_id="node-000")
    decode_node_state(fresh, json.loads(json.dumps(skeleton)), tensors)
    assert torch.equal(fresh.control["w"], torch.arange(3.0)) and fresh.kept == ([1, 2.5], None, "x")  # type: ignore[attr-defined]
    half.module = torch.nn.Linear(2, 2)  # type: ignore[attr-defined]
    with pytest.raises(ResumeError, match=r"module holds a Linear"):
        encode_node_state(half)


def two_seed_grid(tmp_path: Path, name: str) -> Path:
    """The quickstart as a grid of two seeds, FAST's rounds and checkpoints, written to tmp_path/grid.yaml."""
    spec = {
        "extends": str(ROOT / "experiments" / "quickstart.yaml"),
        "name": name,
        "rounds": 6,
        "train": {"local_epochs": 1},
        "simulation": {"checkpoint_every": 2},
        "grid": {"seed": [0, 1]},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_cut_grid_resumes_its_cut_cell_and_keeps_its_finished_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grid_file = two_seed_grid(tmp_path, "quickstart-resume")
    out = tmp_path / "run"
    assert main(["simulate", str(grid_file), "--out", str(out)]) == EXIT_OK
    kept, cut = sorted((out / "cells").iterdir())
    reference = json.loads((cut / "summary.json").read_text()), (cut / "metrics.jsonl").read_text()
    stamp = (kept / "summary.json").stat().st_mtime_ns
    cell = next(c for c in expand(read_yaml(grid_file), source="grid").cells if c.cell_id == cut.name)
    for name in os.listdir(cut):
        (cut / name).unlink()
    _cut_run(cell.config, cut, monkeypatch)
    assert main(["simulate", str(grid_file), "--out", str(out), "--resume"]) == EXIT_OK
    assert (kept / "summary.json").stat().st_mtime_ns == stamp  # finished before: never run again
    summary = json.loads((cut / "summary.json").read_text())
    assert summary["resumed_from_round"] == 1
    assert summary["model_sha256"] == reference[0]["model_sha256"]
    assert (cut / "metrics.jsonl").read_text() == reference[1]


def test_the_command_line_resumes_a_cut_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = [arg for item in FAST for arg in ("--set", item)]
    uncut = tmp_path / "uncut"
    args = ["simulate", str(ROOT / "experiments" / "quickstart.yaml"), *overrides, "--out", str(uncut)]
    assert main(args) == EXIT_OK
    cut = tmp_path / "cut"
    _cut_run(_config(), cut, monkeypatch)
    command = [sys.executable, "-m", "fedmq", "simulate", str(ROOT / "experiments" / "quickstart.yaml"), *overrides]
    done = subprocess.run(
        [*command, "--out", str(cut), "--resume", "--device", "cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    summaries = [json.loads((d / "summary.json").read_text()) for d in (cut, uncut)]
    assert summaries[0]["resumed_from_round"] == 1
    assert summaries[0]["model_sha256"] == summaries[1]["model_sha256"]
    assert (cut / "metrics.jsonl").read_text() == (uncut / "metrics.jsonl").read_text()


def test_a_run_whose_node_state_cannot_be_checkpointed_goes_on_without_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import fedmq.experiments.sim_checkpoint as sim_checkpoint

    def refuse(half: Any) -> Any:
        raise ResumeError("NodeHalf.teacher holds a Module, which a simulation checkpoint cannot keep")

    monkeypatch.setattr(sim_checkpoint, "encode_node_state", refuse)
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="fedmq.experiments.sim_checkpoint"):
        summary = simulate(_config("rounds=3", "simulation.checkpoint_every=1"), out, device=CPU)
    assert summary["state"] == "finished" and not (out / CHECKPOINT).exists()
    assert "no more checkpoints in this run" in caplog.text and "holds a Module" in caplog.text


def test_a_resumed_event_log_drops_the_half_written_line_a_kill_left(tmp_path: Path) -> None:
    from fedmq.coordinator.storage.eventlog import EventLog

    path = tmp_path / "events.jsonl"
    path.write_text('{"log": "fedmq-events", "format": 2}\n{"n": 1, "t": 0.0, "ev": "Start"}\n{"n": 2, "t": 1.5, "e')
    log = EventLog(path)
    log.start({}, resumed={"round": 0, "version": 1, "clock": 1.5})
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # every line is JSON again
    assert lines[1:] == [{"n": 1, "t": 0.0, "ev": "Start"}, {"resume": {"round": 0, "version": 1, "clock": 1.5}}]


def test_resuming_drops_a_half_written_metrics_line(tmp_path: Path) -> None:
    from fedmq.coordinator.storage.run_dir import RunDir

    (tmp_path / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1}\n{"round": 2}\n{"rou')
    RunDir(tmp_path).truncate_metrics_after(1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"round": 0}\n{"round": 1}\n'
