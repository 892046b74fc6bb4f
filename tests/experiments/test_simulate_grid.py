"""`fedmq simulate GRID.yaml --jobs N`: cells in worker processes, the grid's run directory, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from fedmq.experiments.cli import EXIT_OK, main

ROOT = Path(__file__).resolve().parents[2]


def _grid_file(tmp_path: Path) -> Path:
    spec = {
        "extends": str(ROOT / "experiments" / "quickstart.yaml"),
        "name": "quickstart-seeds",
        "rounds": 3,
        "grid": {"method": {"FedAvg": {"name": "fedavg"}, "FedProx": {"name": "fedprox"}}, "seed": [0, 1]},
        "report": {"rows": ["method"], "average_over": ["seed"]},
    }
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_grid_is_simulated_in_parallel_cells_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["simulate", str(_grid_file(tmp_path)), "--out", str(out), "--jobs", "2"]) == EXIT_OK
    assert json.loads((out / "grid.json").read_text())
    cells = sorted((out / "cells").iterdir())
    assert len(cells) == 4
    for cell in cells:
        summary = json.loads((cell / "summary.json").read_text())
        assert summary["state"] == "finished" and summary["mode"] == "simulated"
        rounds = [json.loads(line)["round"] for line in (cell / "metrics.jsonl").read_text().splitlines()]
        assert rounds == [0, 1, 2]  # written as the run went, each evaluation once
    report = (out / "report.md").read_text()
    assert "FedAvg" in report and "FedProx" in report
    stamps = {c: (c / "summary.json").stat().st_mtime_ns for c in cells}
    assert main(["simulate", str(_grid_file(tmp_path)), "--out", str(out), "--jobs", "2"]) == EXIT_OK
    assert {c: (c / "summary.json").stat().st_mtime_ns for c in cells} == stamps  # finished cells were kept


def test_a_grid_cell_simulated_alone_equals_the_same_cell_in_the_grid(tmp_path: Path) -> None:
    out = tmp_path / "run"
    grid = _grid_file(tmp_path)
    assert main(["simulate", str(grid), "--out", str(out), "--jobs", "1"]) == EXIT_OK
    cell = next(c for c in sorted((out / "cells").iterdir()) if "FedProx" in c.name and "seed=1" in c.name)
    alone = tmp_path / "alone"
    args = ["simulate", str(ROOT / "experiments" / "quickstart.yaml"), "--out", str(alone)]
    args += ["--set", "rounds=3", "--set", "seed=1", "--set", "method.name=fedprox"]
    assert main(args) == EXIT_OK
    assert (alone / "metrics.jsonl").read_text() == (cell / "metrics.jsonl").read_text()
