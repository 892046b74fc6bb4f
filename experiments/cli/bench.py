"""`fedmq bench`: the benchmark suites (`experiments.bench`), a table per suite on stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedmq.experiments.cli.exits import EXIT_INTERRUPTED, EXIT_OK
from fedmq.fedcore.errors import ConfigError

HELP = "run the benchmark suite"
DESCRIPTION = (
    "Measure fedmq side by side with the limits of this machine and with other libraries,"
    " as ratios measured in one run, and print a table per suite (and the targets it meets).\n\n"
    "suites:\n  codec      encode/decode of a ResNet-18-sized model vs memcpy, torch.save, safetensors\n"
    "  transport  45 MB to 1 and to 10 nodes through the broker vs a raw TCP socket; small round trips\n"
    "  rounds     round overhead with no training, 10/100/1000 nodes at C = 0.1 and 1.0\n"
    "  flower     the same FedAvg federation in fedmq and in Flower (simulation and deployment)\n"
    "  scale      the most node daemons on one broker, memory per idle node, rounds at 1% participation\n"
    "  hierarchy  1,000 nodes flat vs in 10 bridged sites: bytes into the central broker, coordinator CPU\n"
    "  train      many simulated nodes trained together (vmap) vs one at a time\n"
    "  sim        the simulator's node training vs bare PyTorch (eager, CUDA graph, vmap); simulate's share\n"
    "  async      sync FedAvg vs FedAsync and FedBuff under heterogeneous speeds; async ingest rate; KDIA\n"
    "  node       one node process: start-up time and memory, on the partition and on its own data (--data)\n"
    "  fedsa      FedSA's skew-aware aggregation vs the weighted mean, K = 5 to 50 updates of ResNet-18\n"
    "  teacher    KDIA's teacher modes with 10,000 nodes: memory and time a round vs the exact teacher\n"
    "  secure     secure aggregation (SecAgg, SecAgg+) vs the plain round: time and bytes, 10 and 100 nodes\n"
    "  all        every suite above, in that order"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", default=["all"], metavar="SUITE", help="suites to run (default: all)")
    p.add_argument("--json", type=Path, help="write every figure, ratio and target to this JSON file")
    p.add_argument("--markdown", type=Path, help="write the tables to this markdown file")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: checks the suites run")
    p.add_argument(
        "--broker",
        default="auto",
        help="mosquitto, embedded, auto (mosquitto when installed; default) or an mqtt:// URL",
    )
    p.add_argument("--repeats", type=int, help="timed repetitions per figure (default: each suite's own)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench"), help="scratch space (default runs/bench)")
    p.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a suite-specific setting, e.g. --opt nodes=10,100 (repeatable; see docs/bench.md)",
    )


def run(args: argparse.Namespace) -> int:
    from fedmq.experiments.bench import SUITES, run_suite
    from fedmq.experiments.bench.common import BenchOptions, write_results

    names = list(SUITES) if "all" in args.suites else args.suites
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise ConfigError(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(SUITES)} or all")
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    extra: dict[str, str] = {}
    for item in args.opt:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--opt {item!r}: expected KEY=VALUE")
        extra[key.strip()] = value.strip()
    options = BenchOptions(
        quick=args.quick, broker=args.broker, work_dir=args.work_dir, repeats=args.repeats, extra=extra
    )
    reports = []
    for name in names:
        report = run_suite(name, options, log=lambda text: print(text, file=sys.stderr, flush=True))
        print(report.markdown(), flush=True)
        reports.append(report)
        write_results(reports, args.json, args.markdown)  # after each suite: a long run keeps what it measured
        if report.interrupted:  # Ctrl-C: what it measured is written; the suites after it are not run
            later = names[names.index(name) + 1 :]
            print(
                f"bench {name}: {report.interrupted}; the table above holds what it measured before"
                + (f"; not run: {', '.join(later)}" if later else ""),
                file=sys.stderr,
            )
            return EXIT_INTERRUPTED
    missed = [(r.suite, t.text) for r in reports for t in r.targets if not t.met]
    if missed:
        print(f"{len(missed)} target(s) not met: " + "; ".join(f"{s}: {t}" for s, t in missed), flush=True)
    return EXIT_OK
