"""`python -m fedmq.experiments.bench.method_steps`: each method's vectorised step counted in a short run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmq.experiments.bench.method_steps import main, parse_method, short_run
from fedmq.fedcore.models import build_model

QUICKSTART = Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml"


def _rows(printed: str) -> dict[str, int]:
    """The table's operator counts by method."""
    rows = [line.split("|") for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[1].strip(): int(cells[2]) for cells in rows[1:]}


def test_it_counts_fedprox_beside_fedavg_with_the_proximal_term_a_few_operators(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The quickstart (digits, the CNN): FedProx's step dispatches FedAvg's and its proximal term, which
    takes a dozen operators and one a parameter tensor (its gradient added to the cross-entropy's), where
    the term written tensor by tensor took four a tensor forward alone."""
    assert main([str(QUICKSTART), "fedprox:{mu: 0.1}"]) == 0
    counts = _rows(capsys.readouterr().out)
    assert list(counts) == ["fedavg", "fedprox:{mu: 0.1}"]
    tensors = len(list(build_model("cnn", (1, 8, 8), 10, seed=0).parameters()))
    assert 0 < counts["fedprox:{mu: 0.1}"] - counts["fedavg"] <= 12 + tensors


def test_its_short_run_is_the_experiment_cut_to_two_vectorised_rounds() -> None:
    config = {"nodes": 100, "rounds": 200, "grid": {"seed": [0, 1]}, "train": {"lr": 0.1}, "policy": {"fraction": 0.1}}
    run = short_run(config, parse_method("moon:{mu: 5.0}"))
    assert "grid" not in run and (run["nodes"], run["rounds"], run["eval_every"]) == (20, 2, 2)
    assert run["train"] == {"lr": 0.1, "local_epochs": 1} and run["policy"] == {"fraction": 0.5}
    assert run["simulation"] == {"vectorize": True, "outputs_ahead": True} and run["method"] == {
        "name": "moon",
        "hyperparams": {"mu": 5.0},
    }
    with pytest.raises(SystemExit, match="must be a YAML mapping"):
        parse_method("moon:[1, 2]")


def test_it_says_what_is_wrong_with_a_file_it_cannot_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([str(tmp_path / "missing.yaml"), "fedprox"])
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("[1, 2]")
    with pytest.raises(SystemExit, match="holds no experiment"):
        main([str(tmp_path / "list.yaml"), "fedprox"])
