"""`fedmq simulate GRID.yaml --jobs N`: cells in worker processes, the grid's run directory, resumable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
    assert "| where the time went |" in report and report.count("% training") == 4  # a cell's parts, each row
    stamps = {c: (c / "summary.json").stat().st_mtime_ns for c in cells}
    assert main(["simulate", str(_grid_file(tmp_path)), "--out", str(out), "--jobs", "2"]) == EXIT_OK
    assert {c: (c / "summary.json").stat().st_mtime_ns for c in cells} == stamps  # finished cells were kept


def test_a_grid_cell_simulated_alone_equals_the_same_cell_in_the_grid(tmp_path: Path) -> None:
    """The grid's cells simulated two at a time in one process, a thread each (`--cells-per-process`):
    a cell's metrics, round by round, are those of the same experiment simulated alone."""
    out = tmp_path / "run"
    grid = _grid_file(tmp_path)
    assert main(["simulate", str(grid), "--out", str(out), "--jobs", "1", "--cells-per-process", "2"]) == EXIT_OK
    cell = next(c for c in sorted((out / "cells").iterdir()) if "FedProx" in c.name and "seed=1" in c.name)
    alone = tmp_path / "alone"
    args = ["simulate", str(ROOT / "experiments" / "quickstart.yaml"), "--out", str(alone)]
    args += ["--set", "rounds=3", "--set", "seed=1", "--set", "method.name=fedprox"]
    assert main(args) == EXIT_OK
    assert (alone / "metrics.jsonl").read_text() == (cell / "metrics.jsonl").read_text()


def test_cells_sharing_a_process_report_each_failure_alone(tmp_path: Path) -> None:
    """A cell of a process's threads that fails is reported as its error; its neighbour finishes."""
    from fedmq.experiments.config import read_yaml
    from fedmq.experiments.simulate_grid import simulate_cells

    good = read_yaml(ROOT / "experiments" / "quickstart.yaml") | {"rounds": 1}
    bad = good | {"rounds": "many"}
    results = simulate_cells([bad, good], [str(tmp_path / "bad"), str(tmp_path / "good")], None, 1)
    assert "error" in results[0] and "rounds" in results[0]["error"]
    assert results[1]["state"] == "finished"


def test_cells_per_process_below_one_is_refused(tmp_path: Path) -> None:
    from fedmq.experiments.config import read_yaml
    from fedmq.experiments.grid import expand
    from fedmq.experiments.simulate_grid import simulate_grid

    grid = expand(read_yaml(_grid_file(tmp_path)))
    with pytest.raises(ValueError, match="at least 1"):
        simulate_grid(grid, tmp_path / "run", jobs=1, device=None, threads=1, cells_per_process=0)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_cells_sharing_a_process_refuse_a_model_that_draws_from_the_global_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's model with dropout draws its masks from torch's global random stream, which the threads
    of one process share: `--cells-per-process 2` is refused before any cell runs, saying why and what
    to run instead; one cell a process takes the same grid."""
    (tmp_path / "dropnet.py").write_text(
        "from torch import nn\n\n"
        "def build(input_shape, num_classes):\n"
        "    size = 1\n"
        "    for d in input_shape:\n"
        "        size *= d\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(size, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, num_classes))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    grid = _grid_file(tmp_path)
    spec = yaml.safe_load(grid.read_text()) | {"model": {"name": "dropnet:build"}, "rounds": 1}
    spec["grid"]["seed"] = [0]
    grid.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    code = main(["simulate", str(grid), "--out", str(out), "--jobs", "1", "--cells-per-process", "2"])
    err = capsys.readouterr().err
    assert code != EXIT_OK and "dropout layer" in err and "--cells-per-process 1" in err, err
    assert not (out / "cells").exists()  # refused before any cell ran
    assert main(["simulate", str(grid), "--out", str(out), "--jobs", "1"]) == EXIT_OK


def test_cells_finished_by_another_grid_are_copied_not_simulated_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--cells-from DIR`: a grid's cell that another run directory finished with the same experiment (a
    smaller grid of the same file, here FedAvg alone) is copied in, bit for bit, and only the others run;
    a directory that holds no run is refused."""
    grid = _grid_file(tmp_path)
    spec = yaml.safe_load(grid.read_text()) | {"rounds": 1}
    spec["grid"]["seed"] = [0]
    grid.write_text(yaml.safe_dump(spec))
    first, whole = tmp_path / "fedavg", tmp_path / "whole"
    only = ["--set", "grid.method={FedAvg: {name: fedavg}}"]
    assert main(["simulate", str(grid), "--out", str(first), *only]) == EXIT_OK
    (done,) = (first / "cells").iterdir()
    capsys.readouterr()
    assert main(["simulate", str(grid), "--out", str(whole), "--cells-from", str(first)]) == EXIT_OK
    said = capsys.readouterr().out
    assert "finished in" in said and "1 of 2 cells to simulate" in said, said
    copied = next(c for c in (whole / "cells").iterdir() if "FedAvg" in c.name)
    assert (copied / "metrics.jsonl").read_bytes() == (done / "metrics.jsonl").read_bytes()
    assert (copied / "summary.json").read_bytes() == (done / "summary.json").read_bytes()  # not run again
    assert "FedProx" in (whole / "report.md").read_text()
    code = main(["simulate", str(grid), "--out", str(tmp_path / "x"), "--cells-from", str(tmp_path / "nothing")])
    assert code != EXIT_OK and "--cells-from" in capsys.readouterr().err
    single = ["simulate", str(ROOT / "experiments" / "quickstart.yaml"), "--cells-from", str(first)]
    assert main(single) != EXIT_OK and "is for a grid" in capsys.readouterr().err
