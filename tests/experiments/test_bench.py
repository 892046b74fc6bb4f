"""`fedmq bench`: each suite measures what it says and reports consistent ratios and targets (how fast
anything is, is never asserted: the suites run in --quick mode, on real brokers and processes)."""

from __future__ import annotations

import itertools
import json
import math
import sys
import types
from pathlib import Path

import pytest

from fedmq.experiments.bench import SUITES, run_suite
from fedmq.experiments.bench.common import BenchOptions, Figure, Report, measure, run_keeping
from fedmq.experiments.cli import main


def quick(tmp_path: Path, **extra: str) -> BenchOptions:
    return BenchOptions(quick=True, work_dir=tmp_path, extra=extra)


def figures(report: Report) -> dict[str, Figure]:
    return {f"{f.section}: {f.label}": f for f in report.figures}


def test_measure_times_each_call_after_the_warm_up() -> None:
    calls: list[int] = []
    timing = measure(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(calls) == 6 and len(timing.samples) == 4 and timing.best <= timing.median
    with pytest.raises(ValueError):
        measure(lambda: None, repeats=0)


def test_report_markdown_shows_every_figure_ratio_and_target() -> None:
    report = Report("x", "a title", context={"size": 3})
    report.add("limit", 2.0, "ms", section="s")
    report.add("ours", 4.0, "ms", ratio=0.5, ratio_means="the limit's throughput", section="s", note="n")
    report.target("ours >= 0.4x", "0.50x", True)
    report.target("ours < 1 ms", "4 ms", False)
    text = report.markdown()
    assert "### x: a title" in text and "size: 3" in text
    assert "| ours (n) | 4.000 ms | 0.50x the limit's throughput |" in text
    assert "| ours >= 0.4x | 0.50x | yes |" in text and "| ours < 1 ms | 4 ms | **no** |" in text
    assert json.loads(json.dumps(report.to_json()))["figures"][1]["ratio"] == 0.5


def test_small_figures_and_ratios_keep_two_significant_digits() -> None:
    def figure(value: float, ratio: float | None) -> Figure:
        return Figure("f", value, "ms", ratio=ratio, ratio_means="the round's")

    assert figure(6.2, 0.0052).ratio_text() == "0.0052x the round's"  # was "0.00x": a share that was there
    assert figure(6.2, 0.46).ratio_text() == "0.46x the round's" and figure(1, 0.01).ratio_text().startswith("0.01x")
    assert figure(1, 0.0).ratio_text().startswith("0.00x") and figure(1, 250.4).ratio_text().startswith("250x")
    assert figure(1, math.nan).ratio_text() == "n/a the round's"
    assert figure(0.00042, None).value_text() == "0.00042 ms" and figure(0.042, None).value_text() == "0.042 ms"
    assert figure(math.nan, None).value_text() == "n/a" and figure(0.0, None).value_text() == "0.000 ms"


def cut_suite(options: BenchOptions) -> Report:
    """A synthetic suite that measures one figure, then is interrupted (Ctrl-C) before its second."""
    report = Report("cut", "a suite cut off after its first figure")
    report.add("first", 1.5, "ms", section="part one", ratio=2.0, ratio_means="the reference's")
    raise KeyboardInterrupt


def test_an_interrupted_suite_keeps_what_it_measured_and_logs_each_figure_as_measured() -> None:
    logged: list[str] = []
    report = run_keeping(lambda: cut_suite(BenchOptions()), logged.append)
    assert [f.label for f in report.figures] == ["first"] and report.interrupted.startswith("interrupted after")
    assert logged == ["  part one: first: 1.500 ms (2.00x the reference's)"]
    assert "interrupted after" in report.markdown() and report.to_json()["interrupted"] == report.interrupted
    whole = run_keeping(lambda: Report("whole", "ran to its end"), logged.append)
    assert whole.interrupted == "" and "interrupted" not in whole.markdown()


def test_an_interrupt_before_the_suite_made_its_report_is_raised_again() -> None:
    def before() -> Report:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_keeping(before, lambda _: None)
    report = Report("outside", "made with no suite running")
    report.add("free", 1.0, "s")  # no suite running: nothing logged, nothing kept
    assert report.interrupted == ""


def test_cli_bench_interrupted_writes_what_was_measured_and_runs_no_later_suite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran: list[str] = []
    module = types.ModuleType("fedmq_test_cut_suite")
    module.TITLE, module.run = "cut off", cut_suite  # type: ignore[attr-defined]
    later = types.ModuleType("fedmq_test_later_suite")
    later.TITLE, later.run = "never reached", lambda options: ran.append("later")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, later.__name__, later)
    monkeypatch.setitem(SUITES, "cut", module.__name__)
    monkeypatch.setitem(SUITES, "later", later.__name__)
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["bench", "cut", "later", "--json", str(out), "--markdown", str(md)]) == 130
    (suite,) = json.loads(out.read_text())["suites"]
    assert [f["label"] for f in suite["figures"]] == ["first"] and suite["interrupted"].startswith("interrupted")
    assert "| first | 1.500 ms |" in md.read_text() and ran == []
    err = capsys.readouterr().err
    assert "part one: first: 1.500 ms" in err and "not run: later" in err


def test_the_gpu_calls_bench_modules_write_what_they_measured_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scripts/gpu-tables` stops them with SIGINT when its budget runs out: the figures come back."""
    from fedmq.experiments.bench import sim_compile, sim_profile, simulator

    monkeypatch.setattr(sim_profile, "run", lambda quick, rounds: cut_suite(BenchOptions()))
    monkeypatch.setattr(sim_compile, "run", lambda quick, repeats: cut_suite(BenchOptions()))
    monkeypatch.setattr(simulator, "run", cut_suite)
    for module in (sim_profile, sim_compile, simulator):
        prefix = tmp_path / module.__name__.rsplit(".", 1)[1]
        assert module.main([str(prefix)]) == 130
        written = json.loads(prefix.with_suffix(".json").read_text())
        assert [f["label"] for f in written["figures"]] == ["first"] and written["interrupted"]
        assert "interrupted after" in prefix.with_suffix(".md").read_text()


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_codec_suite_compares_encode_with_memcpy_and_decode_with_the_other_formats(tmp_path: Path) -> None:
    report = run_suite("codec", quick(tmp_path), log=lambda _: None)
    rows = figures(report)
    limit = rows["encode (model -> bytes): memcpy into an existing buffer (the limit)"]
    ours = rows["encode (model -> bytes): **fedmq encode, reused buffer**"]
    assert limit.ratio == 1.0 and ours.ratio == pytest.approx(limit.value / ours.value)
    for name in ("torch.load", "safetensors load", "fedmq decode + checksum of every byte"):
        row = rows[f"decode (bytes -> tensors): {name}"]
        view = rows["decode (bytes -> tensors): **fedmq decode: views on the frame**"]
        assert row.value > 0 and row.ratio == pytest.approx(row.value / view.value)
    assert [t.text for t in report.targets] == [
        "encode into a reused buffer >= 0.5x memcpy's throughput",
        "decode (a view) of 45 MB under 1 ms",
    ]


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_transport_suite_measures_the_bus_and_the_raw_socket_side_by_side(tmp_path: Path) -> None:
    report = run_suite("transport", quick(tmp_path), log=lambda _: None)
    rows = figures(report)
    for nodes in ("1 node", "2 nodes"):
        tcp = next(f for k, f in rows.items() if k.startswith(f"4 MB to {nodes}: raw TCP"))
        bus = next(f for k, f in rows.items() if k.startswith(f"4 MB to {nodes}: **fedmq"))
        assert tcp.value > 0 and bus.ratio == pytest.approx(tcp.value / bus.value)
    assert any("round trip" in f.section for f in report.figures)
    assert report.targets[0].text == "4 MB to one node >= 1 GB/s end to end"


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_rounds_suite_runs_real_federations_and_times_their_rounds(tmp_path: Path) -> None:
    report = run_suite("rounds", quick(tmp_path), log=lambda _: None)
    rows = [f for f in report.figures if f.section == "time per round"]
    assert [f.label for f in rows] == [
        "a small message's round trip through the broker (the floor)",
        "4 nodes, C = 0.5",
    ]
    assert all(f.value > 0 and math.isfinite(f.value) for f in rows)
    floor, round_ = rows
    assert "2 selected" in round_.note and round_.ratio == pytest.approx(round_.value / floor.value)
    cpu = [f for f in report.figures if f.section == "the coordinator's CPU"]
    assert len(cpu) == 1 and cpu[0].value > 0 and math.isfinite(cpu[0].value)  # from the lines' cpu_s
    runs = sorted((tmp_path / "rounds").iterdir())
    metrics = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 5 and all(m["aggregated"] and m["accepted"] == m["selected"] for m in metrics)
    assert all(b["ended_s"] > a["ended_s"] for a, b in itertools.pairwise(metrics))


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_scale_suite_ramps_the_node_count_and_measures_memory(tmp_path: Path) -> None:
    report = run_suite("scale", quick(tmp_path), log=lambda _: None)
    rows = figures(report)
    for nodes in (20, 40):
        live = rows[f"{nodes} node daemons: from launch until every node was live"]
        assert live.value > 0 and math.isfinite(live.value) and "the coordinator waited" in live.note
        per_round, first = rows[f"{nodes} node daemons: time per round"], rows["20 node daemons: time per round"]
        assert per_round.ratio == pytest.approx(per_round.value / first.value)
        assert rows[f"{nodes} node daemons: node hosts' memory (peak RSS, 2 processes)"].value > 50  # MiB
    assert rows["per node: most node daemons that ran rounds here"].value == 40
    assert "per node: memory per idle node daemon (slope)" in rows
    assert report.targets[0].met is False  # 40 nodes are not the 1,000 of the target


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
@pytest.mark.mosquitto
def test_hierarchy_suite_runs_both_federations_and_reads_the_central_broker_s_bytes(tmp_path: Path) -> None:
    """20 nodes flat and in 2 bridged sites (C = 1): the central broker counts fewer bytes for the sites'
    run (2 partial updates a round instead of 20), and the two runs' accuracy is the same, round for round."""
    from fedmq.broker.servers.mosquitto import find_mosquitto

    if find_mosquitto() is None:
        pytest.skip("bridged sites need mosquitto")
    report = run_suite("hierarchy", quick(tmp_path), log=lambda _: None)
    rows = figures(report)
    section = "20 nodes: flat, and in 2 sites"
    flat, sites = (
        rows[f"{section}: bytes into the central broker a round, flat"],
        rows[f"{section}: bytes into the central broker a round, 2 sites"],
    )
    assert flat.value > 0 and sites.ratio == pytest.approx(sites.value / flat.value) and sites.ratio < 1
    figures_ = report.context["figures"]
    assert figures_["flat"]["accuracies"] == pytest.approx(figures_["sites"]["accuracies"], abs=1e-6)
    assert [t.met for t in report.targets][1] is True  # accuracy equal
    assert (tmp_path / "hierarchy").is_dir() and len(list((tmp_path / "hierarchy").iterdir())) == 2


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_cli_bench_writes_json_and_markdown_and_refuses_unknown_suites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    args = ["--quick", "--work-dir", str(tmp_path), "--json", str(out), "--markdown", str(md)]
    assert main(["bench", "codec", *args]) == 0
    data = json.loads(out.read_text())
    assert [s["suite"] for s in data["suites"]] == ["codec"] and data["machine"]["cores"] >= 1
    assert md.read_text().startswith("### codec:")
    assert "### codec:" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert main(["bench", "codec", "--opt", "novalue"]) == 2
    assert list(SUITES) == [
        "codec",
        "transport",
        "rounds",
        "flower",
        "scale",
        "hierarchy",
        "train",
        "sim",
        "async",
        "node",
        "fedsa",
        "teacher",
        "secure",
    ]


@pytest.mark.slow  # a benchmark suite end to end: real processes, brokers or training
def test_secure_suite_times_secure_rounds_beside_the_plain_round(tmp_path: Path) -> None:
    report = run_suite("secure", quick(tmp_path), log=lambda _: None)
    rows = figures(report)
    times = [f for f in report.figures if f.section == "time per round"]
    assert [f.label for f in times] == [
        "4 selected, plain",
        "4 selected, SecAgg (every other node a neighbour)",
        "4 selected, SecAgg+ (2 neighbours)",
    ]
    plain = rows["time per round: 4 selected, plain"]
    assert plain.ratio is None and all(f.ratio == pytest.approx(f.value / plain.value) for f in times[1:])
    sizes = [f for f in report.figures if f.section == "bytes per node and round"]
    assert all(f.value > 0 for f in sizes) and all(f.ratio is not None and f.ratio > 1 for f in sizes[1:])
    secure_runs = [p for p in (tmp_path / "secure").iterdir() if "plain" not in p.name]
    assert len(secure_runs) == 2
    for run_dir in secure_runs:
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert all(line["aggregated"] and line["secagg_survivors"] == 4 for line in lines)
