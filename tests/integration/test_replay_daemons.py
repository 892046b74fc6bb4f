"""Runs of the real daemons over each broker under a shipped scenario, replayed by `fedmq replay`:
every update, aggregated model and evaluation of the recorded run is recomputed and matches, down
to the final model's hash (issue: scripted scenarios, recorded runs and deterministic replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedmq.coordinator.drivers.replay import read_log
from fedmq.experiments.replay import trace_of

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

RUNS = {
    "sync-stable": ["experiments/quickstart.yaml", "rounds=3", "stable.yaml"],
    "async-heavy-stragglers": [
        "experiments/quickstart-async.yaml",
        "engine.aggregations=6",
        "heavy-stragglers.yaml",
    ],
}


def _fedmq(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_scenario_run_over_a_real_broker_replays_every_model_hash(name: str, broker_url: str, tmp_path: Path) -> None:
    config, override, scenario = RUNS[name]
    experiment = tmp_path / "exp.yaml"  # the scenario by file, relative to the experiment
    experiment.write_text(f"extends: {ROOT / config}\nscenario: {ROOT / 'experiments' / 'scenarios' / scenario}\n")
    out = tmp_path / "run"
    done = _fedmq(
        "run", str(experiment), "--set", override, "--broker", broker_url, "--out", str(out), "--processes", "2",
        "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "finished" and len(summary["model_sha256"]) == 64

    replayed = _fedmq("replay", str(out), "--out", str(tmp_path / "replay"))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    report = json.loads((tmp_path / "replay" / "replay.json").read_text())
    assert report["ok"] and report["final_model_sha256"] == summary["model_sha256"]
    lines = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert report["aggregations_matched"] == sum(1 for x in lines if x.get("ev") == "Aggregated") >= 3
    assert report["updates_matched"] == sum(1 for x in lines if x.get("ev") == "UpdateArrived" and x["tensors"]) > 0
    # the scenario was played: every task took its modelled compute time ((0.5 s + 2 ms a sample) x a
    # speed factor, lognormal about 1 in heavy-stragglers), where training takes ~20 ms after the first
    durations = [d for ds in trace_of(read_log(out / "events.jsonl")[1]).durations.values() for d in ds if d]
    assert (
        len(durations) == report["updates_matched"]
        and min(durations) > 0.15
        and sorted(durations)[len(durations) // 2] > 0.5
    )
    assert lines[-1].get("cmd") == "Finish"
