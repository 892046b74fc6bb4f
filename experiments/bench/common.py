"""What every benchmark suite shares: timing, side-by-side figures with their ratios, targets, tables.

A suite measures fedmq and its reference (memcpy, a raw socket, another library, Flower) in the same
run, so that the ratio between them holds even on a noisy machine where absolute figures drift. The
result is a `Report`: rows of `Figure`s (each with the ratio to the figure it is compared with),
the issue's `Target`s as met or not, and the context needed to reproduce it (sizes, versions,
machine). Nothing here asserts a speed: tests check that the suites measure and report, not how fast.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
MIB = 2**20


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call over repeated calls (after warm-up): the median is reported, min and max shown."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.best, "max_s": max(self.samples), "n": len(self.samples)}


def measure(call: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> Timing:
    """Time `call` `repeats` times after `warmup` untimed calls, with the garbage collector paused."""
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be at least 1 and warmup non-negative")
    for _ in range(warmup):
        call()
    samples = []
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            samples.append(time.perf_counter() - started)
    finally:
        if enabled:
            gc.enable()
    return Timing(tuple(samples))


def _decimals(v: float, usual: int) -> int:
    """`usual` decimals, or as many as show two significant digits of a small nonzero `v`: the host's
    6.2 ms of a 1.2 s round is "0.0052x", not "0.00x"."""
    if v == 0 or abs(v) >= 10.0**-usual:
        return usual
    return 1 - math.floor(math.log10(abs(v)))


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured number. `ratio` compares it with the figure named `against` (how is the suite's
    choice, said in `ratio_means`: "x memcpy's throughput", "x faster than Flower", ...)."""

    label: str
    value: float
    unit: str
    ratio: float | None = None
    ratio_means: str = ""
    note: str = ""
    section: str = ""
    """Rows with the same section are grouped under one heading."""

    def value_text(self) -> str:
        v = self.value
        if v != v:  # NaN: not measured
            return "n/a"
        digits = _decimals(v, 3) if abs(v) < 10 else (1 if abs(v) < 1000 else 0)
        return f"{v:,.{digits}f} {self.unit}"

    def ratio_text(self) -> str:
        if self.ratio is None:
            return ""
        if self.ratio != self.ratio:
            return f"n/a {self.ratio_means}".strip()
        digits = _decimals(self.ratio, 2) if abs(self.ratio) < 100 else 0
        return f"{self.ratio:,.{digits}f}x {self.ratio_means}".strip()

    def line(self) -> str:
        """The figure on one line, as it is measured (the log of a suite that is running)."""
        where = f"{self.section}: " if self.section else ""
        ratio = f" ({self.ratio_text()})" if self.ratio is not None else ""
        return f"{where}{self.label}: {self.value_text()}{ratio}"


@dataclass(frozen=True, slots=True)
class Target:
    """A target of the issue, with what was measured against it."""

    text: str
    measured: str
    met: bool


@dataclass
class Report:
    suite: str
    title: str
    figures: list[Figure] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)
    """Sizes, repetitions, versions: what someone needs to read or reproduce the figures."""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """How long the suite took."""
    interrupted: str = ""
    """Why the suite stopped before its end (`run_keeping`); empty when it ran to its end."""

    def __post_init__(self) -> None:
        watch = _WATCH.get()
        if watch is not None:
            watch.reports.append(self)

    def add(self, label: str, value: float, unit: str, **kwargs: Any) -> Figure:
        figure = Figure(label, float(value), unit, **kwargs)
        self.figures.append(figure)
        watch = _WATCH.get()
        if watch is not None:
            watch.log(f"  {figure.line()}")
        return figure

    def target(self, text: str, measured: str, met: bool) -> None:
        self.targets.append(Target(text, measured, bool(met)))

    def markdown(self) -> str:
        lines = [f"### {self.suite}: {self.title}", ""]
        if self.context:
            lines += [
                "; ".join(f"{k}: {_context_text(v)}" for k, v in self.context.items() if not isinstance(v, dict)),
                "",
            ]
        lines += ["| measured | value | side by side |", "|---|---|---|"]
        section = None
        for f in self.figures:
            if f.section and f.section != section:
                section = f.section
                lines.append(f"| **{section}** | | |")
            label = f"{f.label} ({f.note})" if f.note else f.label
            lines.append(f"| {label} | {f.value_text()} | {f.ratio_text()} |")
        if self.targets:
            lines += ["", "| target | measured | met |", "|---|---|---|"]
            lines += [f"| {t.text} | {t.measured} | {'yes' if t.met else '**no**'} |" for t in self.targets]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["markdown"] = self.markdown()
        return out

    def write(self, prefix: Path) -> None:
        """PREFIX.json and PREFIX.md (a suite's module run alone, as on a GPU machine before its wheels)."""
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(json.dumps(self.to_json(), indent=2, default=str))
        prefix.with_suffix(".md").write_text(self.markdown())


@dataclass
class _Watch:
    """The suite that `run_keeping` runs: where its figures are logged, and the reports it made."""

    log: Callable[[str], None]
    reports: list[Report] = field(default_factory=list)


_WATCH: ContextVar[_Watch | None] = ContextVar("fedmq_bench_watch", default=None)


def run_keeping(run: Callable[[], Report], log: Callable[[str], None] = print) -> Report:
    """`run()`'s report, each figure logged as it is measured. Interrupted (Ctrl-C, or `timeout
    --signal=INT` on a lent GPU's minutes), it returns the report as far as it got, `interrupted` and
    with a note that says so, instead of losing every figure with the traceback. An interrupt that
    comes before the suite made its report is raised again: there is nothing to keep."""
    watch = _Watch(log)
    token = _WATCH.set(watch)
    started = time.monotonic()
    try:
        return run()
    except KeyboardInterrupt:
        if not watch.reports:
            raise
        report = watch.reports[0]
        report.interrupted = f"interrupted after {time.monotonic() - started:.0f} s"
        report.notes.append(
            f"The suite was {report.interrupted}: its figures are those measured before, and the rest is missing."
        )
        return report
    finally:
        _WATCH.reset(token)


def _context_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    quick: bool = False
    """Small sizes and few repeats: a check that the suite runs (tests), not figures to publish."""
    broker: str = "auto"
    """'mosquitto', 'embedded', 'auto' (mosquitto when installed) or an mqtt:// URL."""
    work_dir: Path = field(default_factory=lambda: Path("runs") / "bench")
    """Scratch space: run directories of the federations a suite starts."""
    repeats: int | None = None
    """Override each suite's number of timed repetitions."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Suite-specific settings from the command line (``--opt key=value``)."""

    def reps(self, full: int, quick: int = 2) -> int:
        return self.repeats or (quick if self.quick else full)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    from fedmq.broker.servers.mosquitto import find_mosquitto

    binary = find_mosquitto()
    if binary:
        try:
            done = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=5, check=False)
            out["mosquitto"] = (done.stdout or done.stderr).splitlines()[0].strip()
        except (OSError, subprocess.TimeoutExpired, IndexError):
            out["mosquitto"] = binary
    return out


def write_results(reports: list[Report], json_path: Path | None, markdown_path: Path | None) -> None:
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine(), "suites": [r.to_json() for r in reports]}
        json_path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    if markdown_path is not None:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text("\n".join(r.markdown() for r in reports))


def throughput(nbytes: int, seconds: float) -> float:
    """GB/s (10^9 bytes per second)."""
    return nbytes / seconds / GB if seconds > 0 else float("inf")
