"""`python -m fedmq.experiments.bench.sim_profile`: a device's busy share of a round from its profiled
intervals, and the profile of the quick case on this machine (a CPU: the operators side by side)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from fedmq.experiments.bench import sim_profile
from fedmq.experiments.bench.common import Report
from fedmq.experiments.bench.sim_profile import (
    ROUND,
    PathProfile,
    Timeline,
    add_case,
    busy_time,
    device_profile,
    main,
    run,
    timeline,
)


def test_busy_time_is_the_length_of_the_union_of_overlapping_intervals() -> None:
    assert busy_time([]) == 0
    assert busy_time([(0, 2), (1, 3), (5, 6)]) == 4  # two streams overlap on (1, 2)
    assert busy_time([(2, 3), (0, 10)]) == 10  # a kernel inside another's span counts once
    assert busy_time([(4, 5), (0, 1), (1, 2)]) == 3  # unsorted, touching


def test_a_rounds_timeline_splits_its_idle_time_before_between_and_after_the_kernels() -> None:
    t = timeline((0, 10), [(2, 4), (3, 5), (7, 8), (12, 13), (-3, -1)])
    assert t == Timeline(wall=10, busy=4, lead=2, tail=2)
    assert t.between == 2  # (5, 7): the device waits between its kernels
    clipped = timeline((0, 10), [(-1, 1), (9, 11)])  # intervals that straddle the round count inside it only
    assert (clipped.busy, clipped.lead, clipped.tail) == (2, 0, 0)
    idle = timeline((0, 10), [])
    assert (idle.busy, idle.lead, idle.between) == (0, 10, 0)


def test_the_quick_profile_sets_the_simulators_operators_beside_the_references(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run(quick=True, rounds=1)
    rounds = {f.label: f for f in report.figures if f.section.endswith(": a round")}
    assert set(rounds) == {"simulator, rounds kept", "reference: vmap over nodes"}
    assert all(f.value > 0 and f.unit == "ms" for f in rounds.values())
    # the simulator's host phases are named, and its steps are most of a CPU's round; the reference has none
    ours = rounds["simulator, rounds kept"].note
    phases = dict(part.split(" ") for part in ours.split("the host's phases in ms: ")[1].split(", "))
    assert list(phases) == ["plan", "build", "steps", "sync", "results"]
    assert 0 < sum(map(float, phases.values())) <= rounds["simulator, rounds kept"].value * 1.001  # inside the round
    assert "phases" not in rounds["reference: vmap over nodes"].note
    side = [f for f in report.figures if "beside the reference's" in f.section]
    by_label = {f.label: f for f in side}
    # the CNN's backward convolution is in both paths, set side by side (a ratio, not a time asserted)
    backward = by_label["aten::convolution_backward"]
    assert backward.value > 0 and backward.ratio is not None and "calls 4 and 4" in backward.note
    whole = next(f for f in side if f.label.startswith("all "))
    assert whole.value >= sum(f.value for f in side if f is not whole and not f.label.startswith("the other")) * 0.999
    assert main(["--quick", "--rounds", "1", str(tmp_path / "out" / "profile")]) == 0
    assert json.loads((tmp_path / "out" / "profile.json").read_text())["suite"] == "sim-profile"
    assert "aten::convolution_backward" in (tmp_path / "out" / "profile.md").read_text()
    assert "sim-profile" in capsys.readouterr().out


def test_the_profile_refuses_no_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--rounds", "0", "out"])
    assert "--rounds must be at least 1" in capsys.readouterr().err


def _event(name: str, start: float, end: float, device: DeviceType, annotation: bool = False) -> SimpleNamespace:
    """What `device_profile` reads of a torch.profiler FunctionEvent."""
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, is_user_annotation=annotation
    )


def test_a_gpu_trace_gives_each_rounds_timeline_and_its_kernels_by_name() -> None:
    """The CUDA branch, on a trace made by hand: two rounds marked on the host, their device-side spans
    (user annotations) and a memory record left out, the kernels summed by name a round."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event(ROUND, 0, 100, cpu),
        _event(ROUND, 0, 100, cuda, annotation=True),
        _event("aten::conv2d", 20, 30, cpu),  # the host's side of a kernel: not the device's time
        _event("conv_kernel", 20, 50, cuda),
        _event("Memcpy DtoD", 60, 70, cuda),
        _event("[memory]", 80, 80, cuda),
        _event("fedmq.vectorized.plan", 0, 15, cpu),
        _event("fedmq.vectorized.steps", 15, 60, cpu),
        _event("fedmq.vectorized.sync", 60, 95, cpu),
        _event(ROUND, 200, 300, cpu),
        _event("conv_kernel", 210, 250, cuda),
        _event("relu_kernel", 240, 260, cuda),  # overlapping on another stream
    ]
    p = device_profile(events, rounds=2)
    assert p.wall_ms == 0.1  # 100 us a round
    assert p.timelines == [Timeline(100, 40, 20, 30), Timeline(100, 50, 10, 40)]
    assert p.kernels == {"conv_kernel": (35.0, 1.0), "Memcpy DtoD": (5.0, 0.5), "relu_kernel": (10.0, 0.5)}
    assert p.mean(lambda t: t.between) == 0.005  # (10 + 0) us a round on average, in ms
    # the host's phases, ms a round, in `train_vectorized`'s order (one round marked, over two rounds)
    assert p.phases == {"plan": 0.0075, "build": 0, "steps": 0.0225, "sync": 0.0175, "results": 0}
    assert device_profile(events[:6], rounds=1).phases == {}  # a path without the marks: a reference


def test_a_case_whose_profile_fails_is_noted_and_the_others_still_report(monkeypatch: pytest.MonkeyPatch) -> None:
    def fails(*_: object) -> dict[str, object]:
        raise RuntimeError("CUPTI is not available")

    monkeypatch.setattr(sim_profile, "profile_case", fails)
    report = run(quick=True, rounds=1)
    assert report.notes == ["3 nodes of 128, 1 epoch: the profile failed: RuntimeError('CUPTI is not available')"]


def test_a_gpu_profile_whose_graph_replays_were_not_traced_says_so() -> None:
    """A graphed path whose kernels add up to much less than its twin's without graphs: the tracer missed
    the replays, and the report says its busy share cannot be read; a full trace gives no such note."""

    def path(kernel_us: float) -> PathProfile:
        return PathProfile(1.0, [Timeline(1000, 800, 100, 50)], {"conv": (kernel_us, 4.0)}, {})

    for graphed_us, noted in ((10.0, True), (95.0, False)):
        report = Report("sim-profile", "t")
        profiles = {
            "simulator, rounds kept": path(graphed_us),
            "simulator, rounds kept, without graphs": path(100.0),
            "reference: vmap over nodes, CUDA graph": path(90.0),
            "reference: vmap over nodes": path(100.0),
        }
        add_case(report, "a case", torch.device("cuda"), profiles)
        notes = [n for n in report.notes if "not all traced" in n]
        assert notes == (["a case, simulator, rounds kept: its kernels add up to 10 us a round against 100 without"
                          " graphs: the graph's replays were not all traced, so its busy share is too low"]
                         if noted else [])  # fmt: skip
        busy = next(f for f in report.figures if f.label == "simulator, rounds kept")
        assert busy.ratio == 0.8 and "idle 0.1 ms before its first kernel, 0.1 between, 0.1 after" in busy.note
