"""`fedmq bench async`: sync FedAvg against FedAsync and FedBuff under seeded heterogeneous speeds, on
the bus and in virtual time; the async coordinator's ingest rate; KDIA sync against async. What is
measured and how it is reported, never how fast (the suite runs in --quick mode)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedmq.experiments.bench import SUITES, run_suite
from fedmq.experiments.bench.asynchrony import (
    FEDASYNC,
    FEDBUFF,
    QUICK,
    SYNC,
    SYNC_PLAIN,
    Outcome,
    Settings,
    experiment,
    node_delays,
    settings,
)
from fedmq.experiments.bench.common import BenchOptions, Figure, Report


def rows(report: Report, section: str) -> dict[str, Figure]:
    return {f.label: f for f in report.figures if f.section == section}


def section_named(report: Report, start: str) -> str:
    return next(f.section for f in report.figures if f.section.startswith(start))


def check_comparison(report: Report, where: str, figures: dict, labels: list[str]) -> None:
    """Time to the sync run's final accuracy, final accuracies and wasted updates, each row's ratio
    computed from the figures beside it."""
    target = figures["target_accuracy"]
    assert 0 < target <= 1
    times = rows(report, section_named(report, f"{where}: time to sync's final accuracy"))
    assert list(times) == labels
    sync = times[labels[0]]
    assert sync.value > 0 and math.isfinite(sync.value) and sync.ratio == 1.0
    for label in labels[1:]:
        row, run = times[label], figures["runs"][label]
        if math.isnan(row.value):  # not reached: said so, with the best accuracy and when
            assert row.ratio is None and "not reached; best" in row.note and run["best_accuracy"] < target
        else:
            assert row.value > 0 and row.ratio == pytest.approx(sync.value / row.value)
            assert row.value == run["time_to_target_s"]
    finals = rows(report, f"{where}: final accuracy")
    assert list(finals) == labels and finals[labels[0]].value == target
    for label, row in finals.items():
        assert 0 < row.value <= 1 and row.ratio == pytest.approx(row.value / target)
        assert row.value == figures["runs"][label]["final_accuracy"]
    wasted = rows(report, f"{where}: updates wasted (sent, never folded)")
    assert list(wasted) == labels
    for label, row in wasted.items():
        run = figures["runs"][label]
        assert run["sent"] >= run["folded"] > 0
        assert row.value == run["wasted"] == run["sent"] - run["folded"] == sum(run["wasted_by_reason"].values())
    sync_run = figures["runs"][labels[0]]
    assert sync_run["wasted_by_reason"]["late (over-selected)"] > 0  # over-selection 1.3 always wastes
    sync_share = sync_run["wasted"] / sync_run["sent"]
    for label in labels[1:]:
        run = figures["runs"][label]
        assert wasted[label].ratio == pytest.approx(run["wasted"] / run["sent"] / sync_share)


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_async_suite_measures_every_section_and_reports_ratios(tmp_path: Path) -> None:
    assert SUITES["async"] == "fedmq.experiments.bench.asynchrony"
    report = run_suite("async", BenchOptions(quick=True, work_dir=tmp_path), log=lambda _: None)
    figures = report.context["figures"]
    assert set(figures) == {"real", "virtual", "ingest", "kdia_virtual"}  # --quick: KDIA in virtual time only
    labels = [SYNC.label, FEDASYNC.label, FEDBUFF.label]
    check_comparison(report, "bus", figures["real"], labels)
    check_comparison(report, "virtual time", figures["virtual"], [*labels, SYNC_PLAIN.label])
    check_comparison(report, "KDIA, virtual time", figures["kdia_virtual"], list(figures["kdia_virtual"]["runs"]))

    # the federations ran on the bus with the fault delays as their speeds, and asynchronously where asked
    runs = {p.name.rsplit("-", 1)[0]: p for p in (tmp_path / "async").iterdir()}
    assert {
        "sync",
        "fedasync",
        "fedbuff5",
        "ingest-sync-6",
        "ingest-k10-6",
        "ingest-k10-refusals-6",
        "ingest-k1-6",
    } <= set(runs)
    config = (runs["fedbuff5"] / "config.yaml").read_text()
    assert "kind: async" in config and "buffer: 5" in config and "delay_s:" in config
    lines = [json.loads(line) for line in (runs["fedasync"] / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == FEDASYNC.versions_per_round * QUICK.rounds and all(len(r["folded"]) == 1 for r in lines)

    ingest = figures["ingest"]
    section = rows(report, "ingest: 6 noop nodes, MLP of 442 parameters")
    assert len(section) == 4
    sync_row = next(f for label, f in section.items() if label.startswith("sync noop rounds"))
    assert sync_row.value == pytest.approx(ingest["sync"]["updates_per_s"]) and sync_row.ratio == 1.0
    for k in ("k10", "k10-refusals", "k1"):
        refusals = k.endswith("refusals")
        row = next(
            f for label, f in section.items()
            if f"K = {k[1:].split('-')[0]}," in label and ("refusals only" in label) == refusals
        )  # fmt: skip
        assert row.value > 0 and math.isfinite(row.value) and row.value == ingest[k]["updates_per_s"]
        assert row.ratio == pytest.approx(row.value / sync_row.value)
        assert ingest[k]["folded"] > 0 and ingest[k]["span_s"] > 0
    assert [t.text for t in report.targets] == [
        "async reaches sync's final accuracy >= 2x sooner (bus, sync with over-selection)",
        "async coordinator folds >= 1,000 updates/s (noop, tiny model)",
    ]
    text = report.markdown()
    assert "### async:" in text and "median 0.05 s, sigma 0.5" in text
    assert "| **bus: time to sync's final accuracy" in text and "| **virtual time: final accuracy** | | |" in text


def test_speeds_are_seeded_lognormal_with_a_tenth_of_the_nodes_ten_times_slower() -> None:
    ids = [f"node-{i:03d}" for i in range(30)]
    s = Settings()
    delays = node_delays(ids, s)
    assert delays == node_delays(ids, s) and delays != node_delays(ids, Settings(seed=1))
    even = node_delays(ids, Settings(slow_factor=1.0))
    slow = [n for n in ids if delays[n] != even[n]]
    assert len(slow) == 3 and all(delays[n] == pytest.approx(10 * even[n], rel=1e-3) for n in slow)
    assert 0.5 < sorted(even.values())[15] < 2  # median about 1 s


def test_experiments_differ_only_in_the_engine_and_carry_every_speed_as_a_fault() -> None:
    s = Settings()
    sync = experiment(SYNC, s, nodes=30, rounds=30, concurrency=20, kind="mosquitto", name="a")
    buff = experiment(FEDBUFF, s, nodes=30, rounds=30, concurrency=20, kind="mosquitto", name="a")
    assert sync.engine.kind == "sync" and sync.rounds == 30 and sync.policy.over_selection == 1.3
    assert buff.engine.kind == "async" and buff.engine.buffer == 5 and buff.engine.concurrency == 20
    assert buff.engine.aggregations == 120 and buff.engine.staleness.fn == "polynomial"
    assert {n: f.delay_s for n, f in sync.faults.items()} == node_delays(sync.node_ids(), s)
    assert sync.faults == buff.faults and sync.data == buff.data and sync.train == buff.train


def test_settings_come_from_opt_and_unknown_ones_are_refused() -> None:
    opts = BenchOptions(extra={"nodes": "20", "median_s": "0.5", "sections": "virtual,kdia", "kdia_on_bus": "0"})
    s = settings(opts)
    assert (s.nodes, s.median_s, s.sections, s.kdia_on_bus) == (20, 0.5, ("virtual", "kdia"), False)
    with pytest.raises(ValueError, match="unknown setting"):
        settings(BenchOptions(extra={"nope": "1"}))
    with pytest.raises(ValueError, match="sections"):
        settings(BenchOptions(extra={"sections": "real,nope"}))


def test_time_to_accuracy_and_wasted_updates_are_read_from_the_metrics_lines() -> None:
    sync = Outcome(
        "sync",
        [
            {"round": 0, "selected": ["a", "b", "c"], "accepted": ["a", "b"], "late": ["c"], "lost": [],
             "rejected": [], "failed": [], "aggregated": True, "ended_s": 3.0, "accuracy": 0.5},
            {"round": 1, "selected": ["a", "b", "d"], "accepted": ["a", "b"], "late": [], "lost": ["d"],
             "rejected": [], "failed": [], "aggregated": True, "ended_s": 5.0, "accuracy": 0.7},
        ],
        {"startup_seconds": 1.0},
        wall_s=6.0,
    )  # fmt: skip
    assert sync.curve == [(2.0, 0.5), (4.0, 0.7)] and sync.final == (4.0, 0.7)
    assert sync.time_to(0.6) == 4.0 and sync.time_to(0.8) is None and sync.best == (4.0, 0.7)
    sent, folded, why = sync.work()
    assert (sent, folded) == (6, 4) and why["late (over-selected)"] == 1 and why["lost"] == 1
    buffered = Outcome(
        "fedbuff",
        [
            {"version": 1, "folded": ["a", "b"], "stale": 1, "expired": 0, "lost": 0, "rejected": 0, "failed": 0,
             "ended_s": 2.5, "accuracy": 0.75},
            {"version": 2, "folded": ["c", "a"], "stale": 0, "expired": 1, "lost": 0, "rejected": 0, "failed": 0,
             "ended_s": 3.5},
        ],
        {"engine": "async", "startup_seconds": 0.5, "in_flight_at_end": 2, "buffered_at_end": 1},
        wall_s=4.0,
    )  # fmt: skip
    assert buffered.time_to(0.7) == 2.0
    sent, folded, why = buffered.work()
    assert (sent, folded) == (9, 4) and why["stale"] == 1 and why["expired"] == 1
    assert why["in flight at the end"] == 2 and why["buffered at the end"] == 1
