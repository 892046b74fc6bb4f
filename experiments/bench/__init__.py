"""`fedmq bench`: the benchmark suite, each figure side by side with its limit or competitor.

Each suite is a module with ``TITLE`` and ``run(options) -> Report``; they are imported only when
asked for, so that one suite's optional dependency (Flower) never stops another.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

from fedmq.experiments.bench.common import BenchOptions, Report, run_keeping

SUITES: dict[str, str] = {
    "codec": "fedmq.experiments.bench.codec",
    "transport": "fedmq.experiments.bench.transport",
    "rounds": "fedmq.experiments.bench.rounds",
    "flower": "fedmq.experiments.bench.flower",
    "scale": "fedmq.experiments.bench.scale",
    "hierarchy": "fedmq.experiments.bench.hierarchy",
    "train": "fedmq.experiments.bench.training",
    "sim": "fedmq.experiments.bench.simulator",
    "async": "fedmq.experiments.bench.asynchrony",
    "node": "fedmq.experiments.bench.node",
    "fedsa": "fedmq.experiments.bench.fedsa",
    "teacher": "fedmq.experiments.bench.teacher",
    "secure": "fedmq.experiments.bench.secure",
}
"""Suite name -> module, in the order `all` runs them."""


def titles() -> dict[str, str]:
    """Each suite's one-line title (for --help), without running anything."""
    out = {}
    for name, module in SUITES.items():
        try:
            out[name] = importlib.import_module(module).TITLE
        except ImportError as exc:  # a suite not written yet, or a missing optional dependency
            out[name] = f"(unavailable: {exc})"
    return out


def run_suite(name: str, options: BenchOptions, log: Callable[[str], None] = print) -> Report:
    """The suite's report, its figures logged as they are measured; interrupted, what it measured
    before (`Report.interrupted` says so)."""
    if name not in SUITES:
        raise KeyError(f"unknown benchmark {name!r}; choose from {', '.join(SUITES)} or all")
    module = importlib.import_module(SUITES[name])
    started = time.monotonic()
    log(f"bench {name}: {module.TITLE} ...")
    report = run_keeping(lambda: module.run(options), log)
    report.seconds = round(time.monotonic() - started, 1)
    log(f"bench {name}: {report.interrupted or f'done in {report.seconds:.0f} s'}")
    return report
