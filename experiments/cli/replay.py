"""`fedmq replay`: a recorded run replayed in process and checked hash by hash, or re-run with
something changed (`experiments.replay`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedmq.experiments.cli.exits import EXIT_MISMATCH, EXIT_OK
from fedmq.experiments.cli.options import add_out, add_overrides, add_threads, device

HELP = "replay a recorded run and check it, or re-run it counterfactually"
DESCRIPTION = (
    "Without --set: drive the engine in this process (no broker, the recorded clock) with the"
    " run's recorded events, recompute every node's update and every aggregation, and check each update's"
    " and each model's hash against events.jsonl; exit 0 when all match, 5 at the first difference (the"
    " message names the log line, the step, the node and what differed). With --set: the same"
    " availability and per-task timing the run recorded, with the experiment changed (another method,"
    " seed, buffer size...), written to --out."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory with events.jsonl and config.yaml")
    add_out(
        p,
        "write the replay's metrics and summary here (default: none for an exact replay;"
        " runs/NAME-counterfactual-TIMESTAMP with --set)",
    )
    add_overrides(p, "a counterfactual change, e.g. --set method.name=kdia or --set engine.buffer=5 (repeatable)")
    p.add_argument("--device", type=device, help="torch device (default cpu: a CPU run replays bit for bit on the CPU)")
    add_threads(p, "torch threads (default 1, as the node hosts train)", default=1)


def run(args: argparse.Namespace) -> int:
    import json
    from datetime import datetime

    import torch

    from fedmq.experiments.replay import ReplayError, counterfactual, replay_run

    on = torch.device(args.device) if args.device else None
    try:
        if args.overrides:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            out = args.out or Path("runs") / f"{args.run_dir.resolve().name}-counterfactual-{stamp}"
            result = counterfactual(args.run_dir, args.overrides, out, device=on, threads=args.threads)
            print(json.dumps(result, indent=2))
            return EXIT_OK
        outcome = replay_run(args.run_dir, device=on, threads=args.threads)
    except ReplayError as exc:
        print(f"fedmq replay: {exc}", file=sys.stderr)
        return EXIT_MISMATCH
    r = outcome.report
    original = f"{outcome.original_wall_seconds:.1f} s" if outcome.original_wall_seconds is not None else "unknown"
    print(
        f"replayed {r.events} events in {outcome.wall_seconds:.1f} s (the run took {original}): {r.updates} updates,"
        f" {r.aggregations} aggregated models, {r.evaluations} evaluations and {r.commands} engine decisions matched"
    )
    if args.out is not None:
        from fedmq.experiments.replay import write_replay

        write_replay(args.out, outcome)
    if outcome.mismatch is not None:
        print(f"fedmq replay: differs from the recorded run at {outcome.mismatch}", file=sys.stderr)
        return EXIT_MISMATCH
    for note in outcome.notes:
        print(f"fedmq replay: {note}", file=sys.stderr)
    if not outcome.ok:
        return EXIT_MISMATCH
    print(f"final model sha256 {r.final_model_sha256}: identical to the recorded run")
    return EXIT_OK
