"""The teacher scale benchmark runs end to end (tiny sizes) and its figures are consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench_teacher import main


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_bench_teacher_compares_each_mode_with_the_exact_one(tmp_path: Path) -> None:
    out = tmp_path / "teacher.json"
    args = ["--nodes", "60", "--fraction", "0.1", "--rounds", "12", "--modes", "exact,windowed,streaming"]
    assert main([*args, "--json", str(out)]) == 0
    results = {r["mode"]: r for r in json.loads(out.read_text())}
    assert results["exact"]["max_abs_diff_from_exact"] == 0 and results["exact"]["error_share"] == 0
    assert results["streaming"]["models_held"] == 0 < results["exact"]["models_held"]
    # 12 rounds inside the 30-round window: nothing dropped, the exact teacher
    assert results["windowed"]["max_abs_diff_from_exact"] == 0 and results["windowed"]["error_share"] == 0
    # streaming keeps stale contributions: a small, reported error (its bound is tested in test_kdia_teacher)
    assert 0 < results["streaming"]["max_abs_diff_from_exact"] < 0.05 and results["streaming"]["error_share"] > 0


def test_bench_teacher_refuses_bad_sizes() -> None:
    with pytest.raises(SystemExit):
        main(["--fraction", "0"])
