"""A user's own method, model and dataset, run from the user's own folder as a user runs them: `fedmq`
in a subprocess whose current folder holds their package (`tests.user_package`), nothing of theirs
installed. PYTHONPATH names only this checkout, so that the subprocess runs this fedmq."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.daemons import ROOT
from tests.user_package import DATASET, METHOD, MODEL, write_experiment, write_package


def _fedmq(folder: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args],
        capture_output=True, text=True, timeout=timeout, cwd=folder, env=env,
    )  # fmt: skip


def _summary(out: Path) -> dict[str, object]:
    summary = json.loads((out / "summary.json").read_text())
    assert isinstance(summary, dict)
    return summary


def test_simulate_and_replay_a_federation_of_the_user_s_method_model_and_dataset(tmp_path: Path) -> None:
    folder = write_package(tmp_path / "lab")
    write_experiment(folder, rounds=3, method=METHOD, model=MODEL, dataset=DATASET)
    done = _fedmq(folder, "simulate", "experiment.yaml", "--out", "runs/sim")
    assert done.returncode == 0, done.stderr
    summary = _summary(folder / "runs" / "sim")
    final = summary["final_accuracy"]
    assert isinstance(final, float) and final > 0.3  # digits after 3 short rounds: well above chance (0.1)
    config = (folder / "runs" / "sim" / "config.yaml").read_text()
    assert f"name: {METHOD}" in config and f"name: {MODEL}" in config and f"dataset: {DATASET}" in config
    replayed = _fedmq(folder, "replay", "runs/sim")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


def test_a_broken_plug_in_is_one_line_exit_2(tmp_path: Path) -> None:
    folder = write_package(tmp_path / "lab")
    write_experiment(folder, method="mylab.nets")
    done = _fedmq(folder, "simulate", "experiment.yaml", "--out", "runs/sim")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("fedmq: configuration error: method.name:")
    assert "nets.py defines no 'SPEC'" in done.stderr


@pytest.mark.slow
def test_run_starts_daemons_that_find_the_user_s_package_in_the_current_folder(tmp_path: Path) -> None:
    """`fedmq run`: the embedded broker, the coordinator and the node hosts are processes of their own,
    started in the same folder; each imports mylab from it, and their fingerprints match."""
    folder = write_package(tmp_path / "lab")
    write_experiment(folder, rounds=2, method=METHOD, model=MODEL, dataset=DATASET)
    done = _fedmq(folder, "run", "experiment.yaml", "--out", "runs/run", "--quiet", "--processes", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = _summary(folder / "runs" / "run")
    assert summary["rounds_completed"] == 2, summary
