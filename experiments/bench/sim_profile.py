"""Where a vectorised round's time goes on its device, beside the bare `vmap` reference's.

`fedmq bench sim` gives each path's time a round, its ratio to the best reference and the host's work
alone. It cannot say what the rest of the gap is: the device waiting (for the host's plan before the
first step, for the launches between steps) or heavier kernels. This profiles a few rounds of each path
with torch.profiler and gives, a round: the device's busy time (the union of its kernels' and copies'
intervals), its idle time before the first kernel, between kernels and after the last; and the kernels
summed by name, the simulator's beside the reference's, both without CUDA graphs (the kernels a captured
step replays are the same, and are named in every trace). On a CPU there are no device events: the
rounds' times and the operators' self CPU time are given instead.

    python -m fedmq.experiments.bench.sim_profile OUT_PREFIX [--quick] [--rounds N]

needs only torch and numpy, as `fedmq.experiments.bench.simulator`'s main does (a GPU machine before its
wheels are installed); `scripts/gpu-tables`' step `profile` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from fedmq.experiments.bench.common import Report, run_keeping
from fedmq.experiments.bench.simulator import Case, KeptRounds, VmapStep, cases, vectorised, workload
from fedmq.fedcore.host_memory import set_host_memory
from fedmq.fedcore.seeding import deterministic_kernels
from fedmq.fedcore.training import torch_threads
from fedmq.fedcore.vectorized import PHASES

ROUND = "fedmq.bench.round"
"""The profiler's mark around each profiled round."""
TOP_KERNELS = 20
GRAPHED = {
    "simulator, rounds kept": "simulator, rounds kept, without graphs",
    "reference: vmap over nodes, CUDA graph": "reference: vmap over nodes",
}
"""Each path with CUDA graphs, and its twin without: a captured step replays the same kernels."""
NAME_CHARS = 90


@dataclass(frozen=True, slots=True)
class Timeline:
    """One round's device time, in microseconds."""

    wall: float
    busy: float
    """The union of the device's intervals (kernels, copies, fills) inside the round."""
    lead: float
    """From the round's start to its first device interval: the device waits for the host."""
    tail: float
    """From its last device interval to the round's end (the results' copy back and the host's last work)."""

    @property
    def between(self) -> float:
        """Idle time between the round's first and last device intervals: steps waiting for their launch."""
        return self.wall - self.busy - self.lead - self.tail


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) intervals (device streams overlap)."""
    total, reached = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def timeline(window: tuple[float, float], intervals: Sequence[tuple[float, float]]) -> Timeline:
    """The device's time inside `window` (a round's start and end), its `intervals` clipped to it."""
    start, end = window
    inside = [(max(s, start), min(e, end)) for s, e in intervals if e > start and s < end]
    if not inside:
        return Timeline(end - start, 0.0, end - start, 0.0)
    return Timeline(
        end - start,
        busy_time(inside),
        min(s for s, _ in inside) - start,
        end - max(e for _, e in inside),
    )


@dataclass(frozen=True, slots=True)
class PathProfile:
    """A path's rounds, averaged: its device timeline and its kernels (or, on a CPU, operators)."""

    wall_ms: float
    timelines: list[Timeline]
    kernels: dict[str, tuple[float, float]]
    """Name -> (microseconds a round, calls a round): device kernels, or a CPU's operators (self time)."""
    phases: dict[str, float]
    """The simulator's phases on the host (`fedcore.vectorized.PHASES`, short names): ms a round."""

    def mean(self, what: Callable[[Timeline], float]) -> float:
        """The rounds' mean of one timeline figure, in ms."""
        return sum(what(t) for t in self.timelines) / max(len(self.timelines), 1) / 1e3


def profile_path(call: Callable[[], object], device: torch.device, rounds: int) -> PathProfile:
    """`rounds` calls of `call` (a round each), after one that is not profiled (its warm-up: a kept round's
    build and captures), each inside a `ROUND` mark and followed by a device synchronisation."""
    cuda = device.type == "cuda"

    def one() -> None:
        call()
        if cuda:
            torch.cuda.synchronize(device)

    one()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    # acc_events: torch 2.11 (the lent GPU machines') warns without it, on the first cycle too
    with profile(activities=activities, acc_events=True) as prof:
        for _ in range(rounds):
            with record_function(ROUND):
                one()
    events = prof.events()
    if cuda:
        return device_profile(events, rounds)
    kernels = {
        a.key: (a.self_cpu_time_total / rounds, a.count / rounds)
        for a in prof.key_averages()
        if a.key != ROUND and a.key not in PHASES and a.self_cpu_time_total > 0  # operators, not the marks
    }
    return PathProfile(_wall_ms(_windows(events)), [], kernels, host_phases(events, rounds))


def host_phases(events: Sequence[Any], rounds: int) -> dict[str, float]:
    """Milliseconds a round in each of `train_vectorized`'s marked phases, by their short names (plan,
    build, steps, sync, results), in their order; empty for a path without them (the references)."""
    spent = dict.fromkeys(PHASES, 0.0)
    for e in events:
        if e.name in spent and e.device_type == DeviceType.CPU:
            spent[e.name] += (e.time_range.end - e.time_range.start) / rounds / 1e3
    return {name.rsplit(".", 1)[-1]: ms for name, ms in spent.items()} if any(spent.values()) else {}


def _windows(events: Sequence[Any]) -> list[tuple[float, float]]:
    """The profiled rounds' (start, end), from their `ROUND` marks on the host."""
    return [
        (e.time_range.start, e.time_range.end) for e in events if e.name == ROUND and e.device_type == DeviceType.CPU
    ]


def _wall_ms(windows: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in windows) / max(len(windows), 1) / 1e3


def device_profile(events: Sequence[Any], rounds: int) -> PathProfile:
    """A path's profile from a trace's events (torch.profiler's `FunctionEvent`s): each round's device
    timeline and the device's kernels, copies and fills summed by name, not counting the marks'
    device-side spans nor memory records."""
    on_device = [
        e
        for e in events
        if e.device_type != DeviceType.CPU
        and not e.is_user_annotation
        and e.name != ROUND
        and e.name not in PHASES
        and not e.name.startswith("[memory]")
    ]
    intervals = [(e.time_range.start, e.time_range.end) for e in on_device]
    sums: dict[str, list[float]] = {}
    for e in on_device:
        total = sums.setdefault(e.name, [0.0, 0.0])
        total[0] += e.time_range.end - e.time_range.start
        total[1] += 1
    kernels = {name: (t / rounds, n / rounds) for name, (t, n) in sums.items()}
    windows = _windows(events)
    timelines = [timeline(w, intervals) for w in windows]
    return PathProfile(_wall_ms(windows), timelines, kernels, host_phases(events, rounds))


def profile_case(case: Case, device: torch.device, rounds: int) -> dict[str, PathProfile]:
    """The simulator's kept rounds (with and, on a GPU, without graphs) and the vmap reference's rounds
    (likewise), profiled on `device`."""
    model, datasets = workload(case, device)
    paths: dict[str, Callable[[], object]] = {"simulator, rounds kept": KeptRounds(vectorised(model, datasets, case))}
    if device.type == "cuda":
        paths["simulator, rounds kept, without graphs"] = KeptRounds(vectorised(model, datasets, case, graphs="off"))
        paths["reference: vmap over nodes, CUDA graph"] = VmapStep(model, datasets, case, device, graph=True)
    paths["reference: vmap over nodes"] = VmapStep(model, datasets, case, device)
    return {name: profile_path(call, device, rounds) for name, call in paths.items()}


def _short(name: str) -> str:
    name = " ".join(name.split()).replace("|", "/")
    return name if len(name) <= NAME_CHARS else name[: NAME_CHARS - 3] + "..."


def add_case(report: Report, label: str, device: torch.device, profiles: dict[str, PathProfile]) -> None:
    """A case's rows: each path's round and device timeline, then its kernels side by side."""
    section = f"{label}, {device}: a round"
    for name, p in profiles.items():
        host = ", ".join(f"{phase} {ms:.1f}" for phase, ms in p.phases.items())
        host = f"; the host's phases in ms: {host}" if host else ""
        if device.type != "cuda":
            report.add(name, p.wall_ms, "ms", note=f"a CPU: no device timeline{host}", section=section)
            continue
        busy = p.mean(lambda t: t.busy)
        report.add(
            name,
            p.wall_ms,
            "ms",
            ratio=busy / p.wall_ms if p.wall_ms else None,
            ratio_means="of the round the device is busy",
            note=f"device busy {busy:.1f} ms; idle {p.mean(lambda t: t.lead):.1f} ms before its first kernel,"
            f" {p.mean(lambda t: t.between):.1f} between, {p.mean(lambda t: t.tail):.1f} after its last{host}",
            section=section,
        )
        if device.type == "cuda" and not p.kernels:
            report.notes.append(f"{label}, {name}: no kernel was traced (the replays of a graph may not be)")
    for graphed, eager in GRAPHED.items():  # a tracer that misses a graph's kernels would show the device idle
        if device.type == "cuda" and graphed in profiles and eager in profiles:
            seen, expected = (sum(t for t, _ in profiles[n].kernels.values()) for n in (graphed, eager))
            if seen < expected / 2:
                report.notes.append(
                    f"{label}, {graphed}: its kernels add up to {seen:,.0f} us a round against {expected:,.0f}"
                    " without graphs: the graph's replays were not all traced, so its busy share is too low"
                )
    ours_name = "simulator, rounds kept, without graphs" if device.type == "cuda" else "simulator, rounds kept"
    ours, reference = profiles[ours_name].kernels, profiles["reference: vmap over nodes"].kernels
    what = "kernels" if device.type == "cuda" else "operators (self CPU time)"
    section = f"{label}, {device}: {what} a round, without graphs, the simulator's beside the reference's"
    top = sorted(set(ours) | set(reference), key=lambda n: -max(ours.get(n, (0, 0))[0], reference.get(n, (0, 0))[0]))
    for name in top[:TOP_KERNELS]:
        us, calls = ours.get(name, (0.0, 0.0))
        ref_us, ref_calls = reference.get(name, (0.0, 0.0))
        _beside(report, _short(name), us, ref_us, f"; calls {calls:g} and {ref_calls:g}", section)
    rest = top[TOP_KERNELS:]
    rest_us = sum(ours.get(n, (0.0, 0.0))[0] for n in rest)
    rest_ref = sum(reference.get(n, (0.0, 0.0))[0] for n in rest)
    _beside(report, f"the other {len(rest)}", rest_us, rest_ref, "", section)
    total, ref_total = sum(t for t, _ in ours.values()), sum(t for t, _ in reference.values())
    _beside(report, f"all {what}", total, ref_total, "", section)


def _beside(report: Report, label: str, us: float, ref_us: float, more: str, section: str) -> None:
    """A row of the simulator's microseconds a round, as a ratio to the reference's."""
    report.add(
        label,
        us,
        "us",
        ratio=us / ref_us if ref_us else None,
        ratio_means="the reference's time",
        note=f"reference {ref_us:,.0f} us{more}",
        section=section,
    )


def run(quick: bool = False, rounds: int = 2) -> Report:
    """Every case of `fedmq bench sim` (its quick one with `quick`), `rounds` profiled rounds a path."""
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    deterministic_kernels(device)  # the kernels fedmq's training processes choose, for every path
    report = Report(
        "sim-profile",
        "where a vectorised round's time goes on its device, beside the bare vmap reference's",
        context={
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "rounds profiled a path": rounds,
            "torch": torch.__version__,
        },
    )
    with torch_threads(1) if not gpu else contextlib.nullcontext():
        for case in cases(quick, gpu):
            try:
                profiles = profile_case(case, device, rounds)
            except Exception as exc:  # a lent GPU's minutes: the other case's figures still come back
                report.notes.append(f"{case.label}: the profile failed: {exc!r}")
                continue
            add_case(report, case.label, device, profiles)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Writes OUT_PREFIX.json and OUT_PREFIX.md, and prints the markdown."""
    parser = argparse.ArgumentParser(
        prog="python -m fedmq.experiments.bench.sim_profile",
        description="Profile a few rounds of the simulator's vectorised training beside the bare vmap"
        " reference's, on the GPU when there is one: the device's busy share of a round and the kernels"
        " side by side.",
    )
    parser.add_argument("out", type=Path, help="prefix of the .json and .md files written")
    parser.add_argument("--quick", action="store_true", help="the small case only (3 nodes of 128)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds profiled a path, after one warm-up")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    set_host_memory("keep")  # as fedmq simulate and fedmq bench sim run: no page faults for a round's tensors
    report = run_keeping(lambda: run(args.quick, args.rounds), log=lambda text: print(text, file=sys.stderr))
    report.write(args.out)
    print(report.markdown())
    return 130 if report.interrupted else 0  # fedmq's status for an interrupt (its cli package needs the wheels)


if __name__ == "__main__":
    raise SystemExit(main())
