"""`fedmq bench fedsa`: SA and the weighted mean measured at each K, SA's time as a multiple of the mean's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedmq.experiments.bench import run_suite
from fedmq.experiments.bench.common import BenchOptions
from fedmq.experiments.bench.fedsa import QUICK, Settings, report, settings
from fedmq.fedcore.errors import ConfigError


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_fedsa_suite_quick_measures_both_rules_at_each_k(tmp_path: Path) -> None:
    """--quick (1,000 synthetic values, K = 3): one result per rule, sizes as asked, one section for K = 3."""
    result = run_suite("fedsa", BenchOptions(quick=True, work_dir=tmp_path), log=lambda _: None)
    results = result.context["results"]
    assert set(results) == {"mean-3", "sa-3"}
    for r in results.values():
        assert r["updates"] == 3 and r["params"] == 1000 and r["tensors"] == 3
        assert r["input_bytes"] == 3 * 1000 * 4
        assert r["seconds_mean"] > 0 and len(r["seconds"]) == 1
        assert r["peak_extra_device_bytes"] is None
    sa = results["sa-3"]
    assert 0 <= sa["sa_high_share"] <= 1 and sa["sa_layers_clustered"] <= 3
    assert "sa_high_share" not in results["mean-3"]
    mean_row, sa_row = result.figures
    assert mean_row.section == sa_row.section == "K = 3 updates held (0.0 MiB)"
    assert sa_row.ratio == pytest.approx(sa["seconds_mean"] / results["mean-3"]["seconds_mean"])
    assert "| **FedSA's skew-aware average** (" in result.markdown()


def _result(rule: str, k: int, seconds: float) -> dict[str, Any]:
    extra = {"sa_high_share": 0.5, "sa_clusters_mean": 2.0, "sa_unclustered_mean": 1.0} if rule == "sa" else {}
    return {
        "rule": rule,
        "updates": k,
        "params": 1000,
        "tensors": 3,
        "seconds_mean": seconds,
        "input_bytes": k * 2**20,
        "peak_extra_rss_bytes": 2**20,
        "peak_extra_device_bytes": None,
        **extra,
    }


def test_fedsa_report_pairs_each_ks_rules_in_increasing_k() -> None:
    """Each K is one section, mean then SA, in increasing K whatever the order given, SA's time over the mean's."""
    results = [_result("sa", 10, 0.4), _result("mean", 10, 0.1), _result("mean", 5, 0.1), _result("sa", 5, 0.3)]
    rows = report(results, Settings()).figures
    assert [(f.section, f.value) for f in rows] == [
        ("K = 5 updates held (5.0 MiB)", 100.0),
        ("K = 5 updates held (5.0 MiB)", 300.0),
        ("K = 10 updates held (10.0 MiB)", 100.0),
        ("K = 10 updates held (10.0 MiB)", 400.0),
    ]
    assert [f.ratio for f in rows] == [None, pytest.approx(3.0), None, pytest.approx(4.0)]
    assert rows[3].note == (
        "1.0 MiB extra memory; high-dispersion share 5.00e-01, 2.00 clusters and 1.00 unclustered per tensor"
    )


def test_fedsa_settings_come_from_opt_and_repeats() -> None:
    """--opt sets any field (lists comma-separated), --repeats the timed calls, --quick the small sizes."""
    got = settings(BenchOptions(extra={"updates": "5,20", "params": "1000", "threads": "2"}, repeats=3))
    assert (got.updates, got.params, got.threads, got.repeats, got.model) == ((5, 20), 1000, 2, 3, "resnet18")
    assert settings(BenchOptions(quick=True)) == QUICK


@pytest.mark.parametrize(
    "extra", [{"updates": "0"}, {"updates": "a,b"}, {"repeats": "0"}, {"params": "-1"}, {"nope": "1"}]
)
def test_fedsa_settings_refuse_bad_values(extra: dict[str, str]) -> None:
    """Non-positive or non-numeric sizes and unknown settings stop the suite before any work."""
    with pytest.raises(ConfigError):
        settings(BenchOptions(extra=extra))
