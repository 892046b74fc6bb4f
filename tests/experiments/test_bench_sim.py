"""`fedmq bench sim` at its quick size: every path of one case as images/s with its ratio to the best
reference, the references that apply on this device, and fedmq simulate's share of wall time training."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedmq.experiments.bench.common import BenchOptions, Report
from fedmq.experiments.bench.sim_generator import (
    KDIA,
    LR,
    PAPER_STEPS,
    PLAIN,
    WEIGHT_DECAY,
    PlainLoop,
    add_rows,
    generator_work,
)
from fedmq.experiments.bench.simulator import (
    AHEAD_PATHS,
    ALL_K,
    Case,
    _add_cudnn_costs,
    _add_unequal,
    cudnn_costs,
    main,
    run,
    step_costs,
    steps_skipped,
    unequal_shards,
    workload,
)
from fedmq.experiments.bench.training import generators
from fedmq.fedcore.algorithms.kdia.generator import train_generator
from fedmq.fedcore.vectorized import train_vectorized


@pytest.mark.slow  # a benchmark suite end to end: real training, a simulated federation
def test_bench_sim_quick_reports_every_path_against_the_best_reference() -> None:
    report = run(BenchOptions(quick=True))
    others = ("FedSA's", "KDIA's node objective")  # sections of their own, against paths of their own
    training = [f for f in report.figures if f.unit == "images/s" and not f.section.startswith(others)]
    labels = {f.label for f in training}
    expected = {"simulator, one by one", "simulator, vectorised", "simulator, vectorised, rounds kept",
                "reference: eager loop", "reference: vmap over nodes"}  # fmt: skip
    if torch.cuda.is_available():
        expected |= {"simulator, vectorised without graphs", "reference: eager loop, CUDA graph",
                     "reference: vmap over nodes, CUDA graph", AHEAD_PATHS["off"]}  # fmt: skip
    else:  # the batches made ahead beside the CPU's own way, in the step
        expected.add(AHEAD_PATHS["on"])
    assert labels == expected
    best = max(f.value for f in training if f.label.startswith("reference"))
    for f in training:
        assert f.value > 0 and f.ratio is not None and abs(f.ratio - f.value / best) < 1e-6 * f.ratio
    assert not [note for note in report.notes if "section failed" in note]
    assert any(f.section.startswith("FedSA's ResNet-18 with BatchNorm") for f in report.figures)
    sections = ("KDIA's generator", "FedSA's", "KDIA's node objective")
    costs = {f.label for f in report.figures if f.unit in ("ops", "MB") and not f.section.startswith(sections)}
    paths = ("simulator, vectorised", "reference: vmap over nodes")
    assert costs == {f"{p}: {what} a step" for p in paths for what in ("operators", "memory traffic")}
    generator = {f.label for f in report.figures if f.section.startswith("KDIA's generator: a round of 4 steps")}
    assert generator == {KDIA, PLAIN} | {
        f"{p}: {what} a step" for p in (KDIA, PLAIN) for what in ("operators", "memory traffic")
    }
    assert not [note for note in report.notes if "generator section failed" in note]
    assert any(f.section.startswith("KDIA's node objective against FedAvg's") for f in report.figures)
    assert not [note for note in report.notes if "node objective section failed" in note]
    host = next(f for f in report.figures if f.label == "simulator, rounds kept: the host's work alone")
    kept = next(f for f in training if f.label == "simulator, vectorised, rounds kept")
    kept_ms = float(kept.note.removesuffix(" ms a round").replace(",", ""))
    assert host.unit == "ms" and host.value > 0 and host.ratio is not None
    assert abs(host.ratio - host.value / kept_ms) < 0.01 * host.ratio + 1e-3  # a share of the same round
    share = next(f for f in report.figures if "share of wall time training" in f.label)
    assert 0 < share.value <= 100 and "images/s over the run" in share.note
    plans = {f.label: f for f in report.figures if f.unit == "ms" and f.section.startswith("host: a KDIA round")}
    first_chunk = "pipelined plan: its first chunk (simulation.pipeline, on a GPU)"
    assert set(plans) == {"plan drawn an epoch at a time (the simulator)", "plan drawn a step at a time", first_chunk}
    assert plans[first_chunk].value > 0 and plans[first_chunk].ratio is not None
    fast, slow = plans["plan drawn an epoch at a time (the simulator)"], plans["plan drawn a step at a time"]
    assert fast.value > 0 and fast.ratio is not None and abs(fast.ratio - slow.value / fast.value) < 1e-6 * fast.ratio


def test_bench_sim_module_runs_without_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What a GPU machine runs before its wheels arrive: the node-training part, written as JSON and markdown."""
    assert main([str(tmp_path / "sim"), "--quick"]) == 0
    assert "reference: eager loop" in (tmp_path / "sim.md").read_text()
    assert '"suite": "sim"' in (tmp_path / "sim.json").read_text()
    assert "not measured" in capsys.readouterr().out


def test_the_simulators_step_dispatches_no_more_operators_and_bytes_than_the_bare_vmap_step() -> None:
    """The operators a vectorised step dispatches (on a GPU about one kernel each, what a launch-bound
    step costs) and the bytes they move (what a memory-bound one costs) against the bare vmap reference's,
    on the same case: no more. Counts, not times, so the same on any machine; the per-parameter masked
    update of 2026-11-26 took 2.3x the operators, the step of 2026-11-27 1.11x (a copy per plan tensor,
    the mean's division, the losses' casts); vmap's rule for max-pooling, which copied each pooled map
    into node order and back, 1.01x the bytes (2026-11-28)."""
    costs = step_costs(Case(2, 128, 1), torch.device("cpu"))
    ours, reference = costs["simulator, vectorised"], costs["reference: vmap over nodes"]
    assert reference.ops > 50, costs  # the forward, backward and update of a CNN: the count counts
    assert reference.bytes > 10e6, costs  # its activations: 2 nodes x 64 images x 32 x 32 x 64 channels...
    assert ours.ops <= reference.ops, costs
    assert ours.bytes <= reference.bytes, costs


def test_the_host_work_figure_times_a_call_that_takes_no_step() -> None:
    """`host_work` times the call with its steps skipped: every node's weights come back as they started,
    and the same call outside it trains them."""
    case = Case(2, 64, 1)
    model, datasets = workload(case, torch.device("cpu"))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}

    def call() -> list[dict[str, torch.Tensor]]:
        cpu = torch.device("cpu")
        return [s for s, _ in train_vectorized(model, datasets, case.settings, generators(case.k, cpu))]

    with steps_skipped():
        skipped = call()
    trained = call()
    assert all(torch.equal(state[n], start[n]) for state in skipped for n in start)
    assert all(any(not torch.equal(state[n], start[n]) for n in start) for state in trained)


def test_the_cost_of_determinism_times_both_paths_under_each_cudnn_choice() -> None:
    """What a GPU's bench adds (cuDNN's deterministic algorithms against its default and benchmarked ones),
    run on this CPU, where the flags change nothing: each choice times the kept round and the vmap
    reference, each row's ratio is the deterministic time over its own, and the flags come back."""
    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark
    case = Case(2, 64, 1)
    costs = cudnn_costs(case, torch.device("cpu"), repeats=1)
    assert (cudnn.deterministic, cudnn.benchmark) == before
    paths = {"simulator, vectorised, rounds kept", "reference: vmap over nodes"}
    assert list(costs) == ["deterministic", "default", "benchmark"]
    assert all(set(timings) == paths and all(t.median > 0 for t in timings.values()) for timings in costs.values())
    report = Report("sim", "t")
    _add_cudnn_costs(report, case, torch.device("cpu"), costs)
    rows = {f.label: f for f in report.figures}
    assert len(rows) == 6
    for choice, timings in costs.items():
        for name, timing in timings.items():
            row = rows[f"{name}, cuDNN {choice}"]
            assert row.ratio == pytest.approx(costs["deterministic"][name].median / timing.median)
            assert row.value == pytest.approx(case.k * case.size / timing.median)
    assert all(rows[f"{name}, cuDNN deterministic"].ratio == pytest.approx(1.0) for name in paths)


def test_the_unequal_shards_rows_time_both_ways_of_capturing_steps() -> None:
    """What a GPU's bench adds for shards of unequal sizes, run on this CPU (no graphs: both paths train
    the same eager steps): two timings, each row's ratio the all-K time over its own."""
    sizes = (40, 9, 17)
    timings = unequal_shards(torch.device("cpu"), repeats=1, sizes=sizes)
    assert len(timings) == 2 and all(t.median > 0 for t in timings.values())
    report = Report("sim", "t")
    _add_unequal(report, torch.device("cpu"), timings, sizes)
    rows = {f.label.removeprefix("simulator, vectorised, rounds kept: "): f for f in report.figures}
    assert set(rows) == set(timings)
    before = timings[ALL_K].median
    for name, timing in timings.items():
        assert rows[name].ratio == pytest.approx(before / timing.median)
        assert rows[name].value == pytest.approx(sum(sizes) / timing.median)


def test_the_generators_plain_reference_trains_the_same_steps_as_kdia() -> None:
    """The plain loop is KDIA's generator round written plainly, not other work: from the same weights and
    draws its generator ends where KDIA's does, but for fused Adam's rounding (1.5e-7 after 30 steps here)."""
    work = generator_work(torch.device("cpu"), 6)
    plain = PlainLoop(work)
    plain()
    generator = copy.deepcopy(work.generator)
    stats, _ = train_generator(
        generator, work.ensemble, epochs=1, batches_per_epoch=6, batch_size=64, lr=LR, weight_decay=WEIGHT_DECAY,
        rng=torch.Generator().manual_seed(0), device=torch.device("cpu"),
    )  # fmt: skip
    ours, theirs, start = generator.state_dict(), plain.net.state_dict(), work.generator.state_dict()
    assert stats.steps == 6 and any(not torch.equal(ours[k], start[k]) for k in ours)  # it trained
    for k in ours:
        torch.testing.assert_close(theirs[k], ours[k], rtol=0, atol=1e-5)


def test_the_generator_rows_give_each_round_its_step_and_the_papers_steps_as_arithmetic() -> None:
    report = Report("sim", "t")
    add_rows(report, torch.device("cpu"), repeats=1, quick=True)
    rows = {f.label: f for f in report.figures}
    kdia, plain = rows[KDIA], rows[PLAIN]
    assert kdia.unit == plain.unit == "ms" and kdia.value > 0 and plain.value > 0
    assert kdia.ratio == pytest.approx(plain.value / kdia.value) and plain.ratio == pytest.approx(1.0)
    per_step = kdia.value / 4
    assert f"{per_step:.3f} ms a step" in kdia.note
    assert f"{per_step * PAPER_STEPS / 1e3:.2f} s a round" in kdia.note and "not timed" in kdia.note
    ops = rows[f"{KDIA}: operators a step"], rows[f"{PLAIN}: operators a step"]
    assert all(o.value > 50 for o in ops)  # a generator's forward, backward and Adam: the count counts


def test_an_unknown_host_memory_is_a_clear_error_before_anything_is_timed() -> None:
    from fedmq.fedcore.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--opt host_memory: 'x': expected keep or system"):
        run(BenchOptions(quick=True, extra={"host_memory": "x"}))


def test_the_cpu_target_is_judged_without_the_config_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m fedmq.experiments.bench.simulator` runs where only torch is installed: the CPU target reads
    `simulation.vectorize: auto`'s rule, so it judges with the config module (and pydantic) unimportable."""
    import sys

    from fedmq.experiments.bench.common import Timing
    from fedmq.experiments.bench.simulator import cpu_target

    monkeypatch.setitem(sys.modules, "fedmq.experiments.config", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "pydantic", None)
    report = Report("sim", "t")
    slower = {"simulator, one by one": Timing((1.0,)), "simulator, vectorised": Timing((2.0,))}
    cpu_target(report, Case(2, 64, 1), slower)
    (target,) = report.targets
    assert target.met and "vectorised 0.50x one by one's speed" in target.measured
