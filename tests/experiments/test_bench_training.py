"""`fedmq bench train` at its quick size: it measures both ways, reports ratios and differences, checks float64."""

from __future__ import annotations

import pytest
import torch

from fedmq.experiments.bench.common import BenchOptions
from fedmq.experiments.bench.training import run


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_bench_train_quick_reports_each_case_side_by_side() -> None:
    """Each case gives a one-by-one row and a vectorised row with its ratio and weight difference; the
    float64 target is met, and the missing GPU is said, not hidden."""
    report = run(BenchOptions(quick=True))
    rows = [(f.label, f.section) for f in report.figures]
    assert len(rows) == 4 and {label for label, _ in rows} == {"K = 3: one by one", "K = 3: vectorised"}
    for alone, together in zip(report.figures[::2], report.figures[1::2], strict=True):
        assert alone.section == together.section and alone.value > 0 and together.value > 0
        assert together.ratio is not None and abs(together.ratio - alone.value / together.value) < 1e-9
        assert "largest weight difference" in together.note
    assert all(0 <= d < 1e-5 for d in report.context["max_abs_difference"].values())
    assert [t.met for t in report.targets] == [True] * len(report.targets)
    assert any("No CUDA device" in n for n in report.notes) != torch.cuda.is_available()
    table = [line for line in report.markdown().splitlines() if line.startswith("| K = ")]
    assert len(table) == 4 and all(line.count("|") == 4 for line in table), table  # no stray column
