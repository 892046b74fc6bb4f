"""`fedmq bench teacher`: each teacher mode's memory and time beside the exact teacher's, and its distance from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.experiments.bench import run_suite
from fedmq.experiments.bench.common import BenchOptions
from fedmq.experiments.bench.teacher import MODES, QUICK, Settings, report, settings
from fedmq.fedcore.errors import ConfigError


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_teacher_suite_compares_each_mode_with_the_exact_one(tmp_path: Path) -> None:
    """--quick: 60 nodes, 12 rounds inside the window: windowed is exact, streaming a small, reported error."""
    result = run_suite("teacher", BenchOptions(quick=True, work_dir=tmp_path), log=lambda _: None)
    results = result.context["results"]
    assert list(results) == ["exact", "windowed", "streaming"]
    assert results["exact"]["max_abs_diff_from_exact"] == 0 and results["exact"]["error_share"] == 0
    assert results["streaming"]["models_held"] == 0 < results["exact"]["models_held"]
    # 12 rounds inside the 30-round window: nothing dropped, the exact teacher
    assert results["windowed"]["max_abs_diff_from_exact"] == 0 and results["windowed"]["error_share"] == 0
    # streaming keeps stale contributions: a small, reported error (its bound is tested in test_kdia_teacher)
    assert 0 < results["streaming"]["max_abs_diff_from_exact"] < 0.05 and results["streaming"]["error_share"] > 0
    memory = {f.label: f for f in result.figures if f.section == "resident memory growth"}
    assert memory["exact"].ratio == 1.0
    assert memory["streaming"].ratio == pytest.approx(memory["streaming"].value / memory["exact"].value)


def _result(mode: str, rss_mib: float, seconds: float) -> dict[str, Any]:
    return {
        "mode": mode,
        "per_round": 100,
        "nodes_seen": 9512,
        "model_params": 4810,
        "model_bytes": 19240,
        "teacher_tensor_bytes_in_memory": 2**20,
        "store_bytes_on_disk": 0,
        "rss_growth_bytes": rss_mib * 2**20,
        "seconds_per_round_mean": seconds,
        "models_held": 10.0,
        "error_share": 0.0,
    }


def test_teacher_report_gives_each_mode_as_a_multiple_of_the_exact_teacher() -> None:
    """Memory and time rows per mode, each with its ratio to exact's; none without the exact mode."""
    rows = report([_result("exact", 100.0, 0.2), _result("streaming", 10.0, 0.01)], Settings()).figures
    assert [(f.section, f.label, f.ratio) for f in rows] == [
        ("resident memory growth", "exact", 1.0),
        ("resident memory growth", "streaming", pytest.approx(0.1)),
        ("time a round (the half's aggregate)", "exact", 1.0),
        ("time a round (the half's aggregate)", "streaming", pytest.approx(0.05)),
    ]
    assert all(f.ratio is None for f in report([_result("streaming", 10.0, 0.01)], Settings()).figures)


def test_teacher_settings_come_from_opt() -> None:
    """--opt sets any field (modes and input_shape comma-separated); --quick the small sizes."""
    got = settings(BenchOptions(extra={"nodes": "1000", "fraction": "0.1", "modes": "exact,streaming"}))
    assert (got.nodes, got.fraction, got.modes, got.rounds) == (1000, 0.1, ("exact", "streaming"), 300)
    assert settings(BenchOptions(quick=True)) == QUICK and Settings().modes == tuple(MODES)


@pytest.mark.parametrize("extra", [{"fraction": "0"}, {"nodes": "0"}, {"modes": "exact,nope"}, {"nope": "1"}])
def test_teacher_settings_refuse_bad_values(extra: dict[str, str]) -> None:
    """A fraction outside (0, 1], no nodes, an unknown mode or setting stop the suite before any work."""
    with pytest.raises(ConfigError):
        settings(BenchOptions(extra=extra))
