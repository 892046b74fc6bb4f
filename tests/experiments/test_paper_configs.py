"""The papers' experiment files: they load, and each reduced one keeps its paper's setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmq.experiments.config import read_yaml
from fedmq.experiments.grid import load_experiment
from fedmq.fedcore.aggregation import build_aggregator
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm

PAPERS = Path(__file__).resolve().parents[2] / "experiments" / "papers"
COMPANIONS = {
    "fedvls-beta005-seeds",
    "fedvls-beta005-seeds-authors",
    "fedvls-beta005-authors",
    "fedvls-beta005-one-split",
    "fedacd-beta01",
    "fedrcl-alpha03",
}
"""Companions of a paper's files, neither its full nor its reduced config (more seeds for a few methods,
the authors' evaluation pipeline, a GPU session's first cells): they load and name valid methods (the
last test), nothing more."""
FULL = sorted(p for p in PAPERS.glob("*.yaml") if not p.stem.endswith("-reduced") and p.stem not in COMPANIONS)


def test_every_paper_has_a_full_and_a_reduced_config() -> None:
    """experiments/papers holds one full-scale and one reduced-scale file per paper."""
    papers = {"kdia", "fedvls", "fedrcl", "fedsa", "fedacd"}
    assert papers <= {p.stem for p in FULL} <= papers | {"kdia-beta01", "kdia-table3", "kdia-table5", "kdia-table7"}
    for full in FULL:
        assert (PAPERS / f"{full.stem}-reduced.yaml").exists(), full.stem


@pytest.mark.parametrize("full", FULL, ids=lambda p: p.stem)
def test_paper_config_loads_and_its_reduced_form_keeps_the_setting(full: Path) -> None:
    """Every cell validates; the reduced file extends the full one and keeps nodes, C and the split kind,
    and says in its comments what it reduced."""
    grid = load_experiment(full)
    reduced_path = PAPERS / f"{full.stem}-reduced.yaml"
    reduced = load_experiment(reduced_path)
    assert grid.is_grid and reduced.is_grid and grid.report.paper
    assert "extends:" in reduced_path.read_text() and "reduced" in reduced_path.read_text().lower()
    assert read_yaml(reduced_path)["name"] != read_yaml(full)["name"]
    first, small = grid.cells[0].config, reduced.cells[0].config
    assert (small.nodes, small.fraction) == (first.nodes, first.fraction)
    assert small.rounds < first.rounds
    assert len(reduced.cells) <= len(grid.cells)
    # every paper figure names a column the full grid produces (so it lands beside ours)
    columns = {", ".join(c.labels[k] for k in c.labels if k not in ("method", "seed")) for c in grid.cells}
    for row, figures in grid.report.paper.items():
        assert set(figures) <= columns, (row, set(figures) - columns)


@pytest.mark.parametrize("path", sorted(PAPERS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_cell_names_a_registered_method_with_valid_hyperparameters(path: Path) -> None:
    """A typo in a method's name or hyperparameter fails here, not hours into a grid on a GPU machine."""
    for cell in load_experiment(path).cells:
        method = cell.config.method
        build_hyperparams(get_algorithm(method.name), method.hyperparams)
        build_aggregator(method.aggregator.name, method.aggregator.options)
