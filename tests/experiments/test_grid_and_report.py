"""Experiment grids (expansion, validation) and the report built from saved metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from fedmq.experiments.grid import expand
from fedmq.experiments.report import load, write_report
from fedmq.fedcore.errors import ConfigError

BASE: dict[str, Any] = {
    "name": "g",
    "nodes": 4,
    "rounds": 3,
    "data": {"dataset": "digits"},
    "model": {"name": "mlp"},
}


def test_grid_expand_is_the_cartesian_product_in_file_order() -> None:
    """Two methods x two alphas x two seeds give eight validated cells with labels and stable ids."""
    grid = expand(
        BASE
        | {
            "grid": {
                "method": {
                    "FedAvg": {"name": "fedavg"},
                    "Mean": {"name": "fedavg", "hyperparams": {"weighted": False}},
                },
                "partition.alpha": [0.1, 0.5],
                "seed": [0, 1],
            }
        }
    )
    assert len(grid.cells) == 8 and grid.is_grid
    first, last = grid.cells[0], grid.cells[-1]
    assert first.labels == {"method": "FedAvg", "partition.alpha": "0.1", "seed": "0"}
    assert first.cell_id == "000-FedAvg_alpha=0.1_seed=0"
    assert last.config.method.hyperparams == {"weighted": False}
    assert (last.config.partition.alpha, last.config.seed) == (0.5, 1)
    assert len({c.cell_id for c in grid.cells}) == 8


def test_grid_without_axes_is_one_cell() -> None:
    """A plain experiment file is a grid of one cell with no labels."""
    grid = expand(dict(BASE))
    assert not grid.is_grid and len(grid.cells) == 1 and grid.cells[0].labels == {}


@pytest.mark.parametrize(
    ("grid", "report", "message"),
    [
        ({"policy.fraction": [0.5, 2.0]}, None, "cell policy.fraction=2"),
        ({"not..path": [1]}, None, "not a dotted config path"),
        ({"seed": 3}, None, "give a list of values"),
        ({"seed": []}, None, "no values"),
        ({"name": ["a", "b"]}, None, "cannot vary"),
        ({"seed": [0, 1]}, {"rows": ["method"]}, "report names axes ['method']"),
        ({"seed": [0, 1]}, {"paper_metric": "median"}, "report.paper_metric"),
        ({"method": [{"name": "fedavg"}, {"name": "fedavg"}]}, None, "labels ['fedavg', 'fedavg'] repeat"),
    ],
)
def test_grid_invalid_declarations_name_the_problem(grid: dict[str, Any], report: Any, message: str) -> None:
    """Every bad grid or report is refused at load time with a message naming the culprit."""
    data = BASE | {"grid": grid} | ({"report": report} if report else {})
    with pytest.raises(ConfigError) as info:
        expand(data, source="exp.yaml")
    assert message in str(info.value)


def _fake_run(directory: Path, accuracies: list[float | None], state: str = "finished") -> None:
    directory.mkdir(parents=True)
    lines = [{"round": r, **({"accuracy": a} if a is not None else {})} for r, a in enumerate(accuracies)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (directory / "summary.json").write_text(json.dumps({"state": state, "rounds_completed": len(accuracies)}))


def _fake_grid(tmp_path: Path, runs: dict[tuple[str, str, str], list[float | None]], report: dict[str, Any]) -> Path:
    cells = []
    for i, ((method, alpha, seed), accs) in enumerate(runs.items()):
        cell_id = f"{i:03d}"
        cells.append({"index": i, "id": cell_id, "labels": {"method": method, "partition.alpha": alpha, "seed": seed}})
        _fake_run(tmp_path / "cells" / cell_id, accs)
    axes = [{"key": k, "labels": [], "explicit": k == "method"} for k in ("method", "partition.alpha", "seed")]
    (tmp_path / "grid.json").write_text(json.dumps({"name": "fake", "axes": axes, "cells": cells, "report": report}))
    return tmp_path


def test_report_tables_are_mean_and_population_std_over_seeds(tmp_path: Path) -> None:
    """Best, final, last-k mean and EMA per (method, setting) equal the hand-computed values."""
    run = _fake_grid(
        tmp_path,
        {
            ("A", "0.1", "0"): [0.1, 0.5, 0.4],
            ("A", "0.1", "1"): [0.2, 0.3, 0.6],
            ("B", "0.1", "0"): [0.3, None, 0.7],  # round 1 not evaluated
            ("B", "0.1", "1"): [0.1, 0.2, 0.9],
        },
        {"last_k": 2, "ema": 0.5},
    )
    write_report(run, plots=False)
    tables = json.loads((run / "report.json").read_text())["tables"]
    a, b = tables["best"]["A"]["alpha=0.1"], tables["final"]["B"]["alpha=0.1"]
    assert a["values"] == [0.5, 0.6] and math.isclose(a["mean"], 0.55) and math.isclose(a["std"], 0.05)
    assert b["values"] == [0.7, 0.9] and math.isclose(b["std"], 0.1)
    assert tables["last_mean"]["A"]["alpha=0.1"]["values"] == pytest.approx([0.45, 0.45])
    # EMA 0.5 over the evaluated rounds: 0.3 -> 0.5*0.3 + 0.5*0.7 = 0.5
    assert tables["ema"]["B"]["alpha=0.1"]["values"][0] == pytest.approx(0.5)
    md = (run / "report.md").read_text()
    assert "| A | 55.00 ± 5.00 |" in md  # best
    assert "| B | 80.00 ± 10.00 |" in md  # final


def test_report_rounds_to_the_baselines_best_use_the_seed_averaged_curve(tmp_path: Path) -> None:
    """The target is the baseline's best mean accuracy; rounds count from 1; speed-up is their ratio."""
    run = _fake_grid(
        tmp_path,
        {
            ("FedAvg", "0.5", "0"): [0.2, 0.4, 0.6, 0.5],
            ("FedAvg", "0.5", "1"): [0.2, 0.4, 0.4, 0.7],  # mean curve 0.2, 0.4, 0.5, 0.6: best 0.6 at round 4
            ("KDIA", "0.5", "0"): [0.5, 0.7, 0.7, 0.7],
            ("KDIA", "0.5", "1"): [0.3, 0.5, 0.7, 0.7],  # mean 0.4, 0.6: reaches 0.6 at round 2
            ("Slow", "0.5", "0"): [0.1, 0.1, 0.1, 0.1],
        },
        {"baseline": "FedAvg", "paper": {"KDIA": {"alpha=0.5": 61.2}}},
    )
    write_report(run, plots=False)
    report = json.loads((run / "report.json").read_text())
    rounds = report["rounds_to_target"]
    assert rounds["FedAvg"]["alpha=0.5"] == {"target": pytest.approx(0.6), "rounds": 4}
    assert rounds["KDIA"]["alpha=0.5"]["rounds"] == 2
    assert rounds["Slow"]["alpha=0.5"]["rounds"] is None
    md = (run / "report.md").read_text()
    assert "| KDIA | 2 (2.00x) |" in md and "| Slow | not within 4 |" in md
    assert "| KDIA | 70.00 ± 0.00 | 61.20 |" in md  # best beside the paper's figure


def test_report_lists_the_papers_methods_that_were_not_run(tmp_path: Path) -> None:
    """A method the paper reports but the grid did not run appears beside the paper with n/a for ours."""
    run = _fake_grid(
        tmp_path,
        {("FedAvg", "0.1", "0"): [0.5]},
        {"paper": {"FedAvg": {"alpha=0.1": 50.4}, "MOON": {"alpha=0.1": "48.82±2.61"}}},
    )
    write_report(run, plots=False)
    md = (run / "report.md").read_text()
    assert "| FedAvg | 50.00 | 50.40 |" in md and "| MOON | n/a | 48.82±2.61 |" in md


def test_report_of_a_single_run_directory(tmp_path: Path) -> None:
    """`fedmq report` works on a plain run: one row named after the method, curves written."""
    _fake_run(tmp_path / "run", [0.3, 0.6])
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"state": "finished", "method": "fedavg"}))
    write_report(tmp_path / "run")
    data = load(tmp_path / "run")
    assert data.rows == ["fedavg"] and data.columns == ["all"]
    assert (tmp_path / "run" / "curves-all.png").stat().st_size > 5000
    assert "| fedavg | 60.00 |" in (tmp_path / "run" / "report.md").read_text()


def test_report_missing_results_are_reported_not_fatal(tmp_path: Path) -> None:
    """A cell that never ran shows as 'not run' and n/a; a cut-off metrics line is skipped."""
    run = _fake_grid(tmp_path, {("A", "0.1", "0"): [0.5]}, {})
    with (run / "cells" / "000" / "metrics.jsonl").open("a") as fh:
        fh.write('{"round": 1, "accur')
    grid = json.loads((run / "grid.json").read_text())
    grid["cells"].append({"index": 1, "id": "001", "labels": {"method": "B", "partition.alpha": "0.1", "seed": "0"}})
    (run / "grid.json").write_text(json.dumps(grid))
    write_report(run, plots=False)
    md = (run / "report.md").read_text()
    assert "| 001 | not run | 0 | n/a | n/a | n/a |" in md and "| B | n/a |" in md


def test_cell_ids_are_ascii_and_spell_out_greek_labels() -> None:
    """Explicit labels such as α=0.05 become alpha=0.05 in directory names; nothing non-ASCII remains."""  # noqa: RUF002
    grid = expand(
        BASE
        | {
            "grid": {
                "partition": {"α=0.05": {"kind": "dirichlet", "alpha": 0.05}, "iid": {"kind": "iid"}},  # noqa: RUF001
                "train.lr": {"η=0.1": 0.1},
            }
        }
    )
    assert [c.cell_id for c in grid.cells] == ["000-alpha=0.05_lr=0.1", "001-iid_lr=0.1"]


def test_report_gives_each_evaluated_model_its_own_row(tmp_path: Path) -> None:
    """A run that evaluates a second model (KDIA's teacher, metrics key accuracy_teacher) adds a row
    'KDIA (teacher)' with that model's numbers, beside the first model's row."""
    _fake_run(tmp_path / "cells" / "000", [0.2, 0.4])
    lines = [
        {"round": 0, "accuracy": 0.2, "accuracy_teacher": 0.3},
        {"round": 1, "accuracy": 0.4, "accuracy_teacher": 0.5},
    ]
    (tmp_path / "cells" / "000" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cells = [{"index": 0, "id": "000", "labels": {"method": "KDIA"}, "method": "kdia"}]
    axes = [{"key": "method", "labels": ["KDIA"], "explicit": True}]
    (tmp_path / "grid.json").write_text(json.dumps({"name": "t", "axes": axes, "cells": cells, "report": {}}))
    write_report(tmp_path, plots=False)
    tables = json.loads((tmp_path / "report.json").read_text())["tables"]
    assert tables["best"]["KDIA"]["all"]["values"] == [0.4]
    assert tables["best"]["KDIA (teacher)"]["all"]["values"] == [0.5]


def test_grid_axis_of_several_paths_sets_them_together() -> None:
    """`nodes,policy.fraction` takes [N, C] pairs: three cells, not a cross product; a wrong length is refused."""
    grid = expand(BASE | {"grid": {"nodes,policy.fraction": {"N=4": [4, 0.5], "N=6": [6, 0.5], "C=1": [4, 1.0]}}})
    assert [(c.config.nodes, c.config.fraction) for c in grid.cells] == [(4, 0.5), (6, 0.5), (4, 1.0)]
    assert [c.cell_id for c in grid.cells] == ["000-N=4", "001-N=6", "002-C=1"]
    with pytest.raises(ConfigError, match="each value is a list of 2"):
        expand(BASE | {"grid": {"nodes,policy.fraction": {"x": [4]}}})


def test_a_value_per_axis_label_follows_the_cell() -> None:
    """KDIA's lambda_gen depends on beta: ``{per: partition.alpha, ...}`` picks each cell's value; the
    other method's hyperparameters stay untouched; an unknown axis or a missing label is refused."""
    kdia = {"name": "kdia", "hyperparams": {"lambda_gen": {"per": "partition.alpha", 0.1: 0.01, 0.5: 1.0}}}
    grid = expand(
        BASE | {"grid": {"method": {"FedAvg": {"name": "fedavg"}, "KDIA": kdia}, "partition.alpha": [0.1, 0.5]}}
    )
    values = {(c.labels["method"], c.labels["partition.alpha"]): c.config.method.hyperparams for c in grid.cells}
    assert values == {
        ("FedAvg", "0.1"): {},
        ("FedAvg", "0.5"): {},
        ("KDIA", "0.1"): {"lambda_gen": 0.01},
        ("KDIA", "0.5"): {"lambda_gen": 1.0},
    }
    with pytest.raises(ConfigError, match="no value for '5'"):
        expand(BASE | {"grid": {"method": {"KDIA": kdia}, "partition.alpha": [0.1, 5.0]}})
    with pytest.raises(ConfigError, match="names no grid axis"):
        expand(BASE | {"method": {"name": "kdia", "hyperparams": {"lambda_gen": {"per": "seed", 0: 1.0}}}})
