"""The FedSA aggregation benchmark runs end to end at a tiny size and reports a consistent table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.bench_fedsa import main, table


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_bench_fedsa_measures_both_rules_at_each_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--params 1000 --updates 3: one result per rule, sizes as asked, and one table row for K = 3."""
    out = tmp_path / "fedsa.json"
    assert main(["--params", "1000", "--updates", "3", "--repeats", "1", "--json", str(out)]) == 0
    results = {r["rule"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"mean", "sa"}
    for r in results.values():
        assert r["updates"] == 3 and r["params"] == 1000 and r["tensors"] == 3
        assert r["input_bytes"] == 3 * 1000 * 4
        assert r["seconds_mean"] > 0 and len(r["seconds"]) == 1
        assert r["peak_extra_device_bytes"] is None
    sa = results["sa"]
    assert 0 <= sa["sa_high_share"] <= 1 and sa["sa_layers_clustered"] <= 3
    assert "sa_high_share" not in results["mean"]
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "1,000 parameters in 3 tensors, device cpu"
    assert lines[1].startswith("| K | updates held | mean time | SA time | SA / mean |")
    row = lines[3].split("|")
    assert len(lines) == 4 and row[1].strip() == "3"
    ratio = sa["seconds_mean"] / results["mean"]["seconds_mean"]
    assert float(row[5]) == pytest.approx(ratio, abs=0.06)


def test_bench_fedsa_table_orders_rows_by_k() -> None:
    """The table pairs each K's two rules into one row, in increasing K, whatever the order given."""

    def result(rule: str, k: int, seconds: float) -> dict[str, object]:
        extra = {"sa_high_share": 0.5, "sa_clusters_mean": 2.0, "sa_unclustered_mean": 1.0} if rule == "sa" else {}
        return {
            "rule": rule,
            "updates": k,
            "seconds_mean": seconds,
            "input_bytes": k * 2**20,
            "peak_extra_rss_bytes": 2**20,
            "peak_extra_device_bytes": None,
            **extra,
        }

    text = table([result("sa", 10, 0.4), result("mean", 10, 0.1), result("mean", 5, 0.1), result("sa", 5, 0.3)])
    rows = text.splitlines()[2:]
    assert rows[0].startswith("| 5 | 5.0 MiB | 100.0 ms | 300.0 ms | 3.0 |")
    assert rows[1].startswith("| 10 | 10.0 MiB | 100.0 ms | 400.0 ms | 4.0 |")
    assert rows[1].endswith("| 1.0 MiB | 1.0 MiB | 5.00e-01 | 2.00 | 1.00 |")


@pytest.mark.parametrize("args", [["--updates", "0"], ["--updates", "a,b"], ["--repeats", "0"], ["--params", "-1"]])
def test_bench_fedsa_refuses_bad_arguments(args: list[str]) -> None:
    """Non-positive or non-numeric sizes stop the benchmark before any work."""
    with pytest.raises(SystemExit):
        main(args)
