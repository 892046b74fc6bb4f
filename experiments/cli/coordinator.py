"""`fedmq coordinator`: the server daemon, with its optional HTTP API and TensorBoard scalars for
as long as it serves."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from fedmq.experiments.broker_flags import add_access, add_broker, broker_access
from fedmq.experiments.cli import daemon
from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.cli.options import add_experiment, add_federation, add_http, add_out, add_threads
from fedmq.fedcore.errors import ConfigError

logger = logging.getLogger(__name__)


HELP = "run the coordinator daemon"
DESCRIPTION = (
    "Waits for the experiment's nodes, runs its rounds, writes metrics, participation,"
    " checkpoints and a summary to --out."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_broker(p)
    add_experiment(p)
    add_out(p, "run directory (default runs/coordinator)", default=Path("runs/coordinator"))
    add_federation(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in --out; without one yet, start from the beginning (so a supervisor"
        " can always restart with --resume)",
    )
    daemon.add_service(p)
    add_threads(p)
    p.add_argument(
        "--tensorboard",
        nargs="?",
        const=True,
        type=Path,
        metavar="DIR",
        help="write accuracy, loss, round time and update counts per round (or version) as TensorBoard scalars"
        " to DIR (default OUT/tensorboard); needs pip install 'fedmq[tensorboard]'",
    )
    add_http(p)
    add_access(p)


def run(args: argparse.Namespace) -> int:
    return daemon.serve(_serve, args)


async def _serve(args: argparse.Namespace, signals: Any) -> int:
    from fedmq.broker.tuning import tune_process
    from fedmq.coordinator.storage.run_dir import write_json, write_text
    from fedmq.experiments.build import build_coordinator, load_split, partition_report
    from fedmq.experiments.plots import partition_png
    from fedmq.experiments.service import coordinator_status

    if args.tensorboard is not None:
        from fedmq.coordinator.observers.tensorboard import check_installed

        check_installed()  # before loading anything: exit 2 saying what to install
    cfg, notifier = daemon.start(args, signals)
    notifier.status("loading the data")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.resume:
        _resume_or_start(args.out)
    # atomically: `fedmq run` starts node hosts reading this very file while the coordinator starts
    write_text(args.out / "config.yaml", cfg.to_yaml())
    report = partition_report(cfg, load_split(cfg))
    write_json(args.out / "partition.json", report)
    # drawn on a thread beside the start-up (matplotlib's import and the drawing took 1.2 s of a 2-core
    # CPU, which the first round waited for), awaited before the coordinator exits
    drawing = asyncio.create_task(asyncio.to_thread(partition_png, args.out / "partition.png", report))
    try:
        coordinator = build_coordinator(
            cfg, args.broker, args.out, federation=args.federation, resume=args.resume, access=broker_access(args)
        )
        tune_process(coordinator.bus_config)
        with _tensorboard(args, coordinator):
            # the HTTP API first: its options are checked at once, and /readyz says 503 while the broker is awaited
            async with _http_api(args, coordinator, cfg):
                # after what can be checked here: a mistake is said at once
                await daemon.wait_for_broker(args, cfg, notifier)
                async with notifier.running(
                    [coordinator.connected], lambda: coordinator_status(coordinator, cfg.step_name)
                ):
                    summary = await coordinator.serve()
    finally:
        await _drawn(drawing, args.out / "partition.png")
    if summary.final_accuracy is not None:
        print(
            f"final accuracy {summary.final_accuracy:.4f} (best {summary.best_accuracy:.4f}) after"
            f" {summary.rounds_completed} {cfg.step_name}s in {summary.wall_seconds:.1f} s"
        )
    return EXIT_OK if summary.state == "finished" else EXIT_FAILED


async def _drawn(drawing: asyncio.Task[Any], path: Path) -> None:
    """The partition's figure finished; one that could not be drawn is said, not fatal (the run's
    partition.json holds the same histogram)."""
    try:
        await drawing
    except Exception as exc:  # matplotlib's own errors: the figure is a convenience of the run directory
        logger.warning("could not draw %s: %s", path, exc)


@contextlib.contextmanager
def _tensorboard(args: argparse.Namespace, coordinator: Any) -> Iterator[None]:
    """TensorBoard scalars of the metrics lines (`--tensorboard`) for as long as the coordinator serves."""
    if args.tensorboard is None:
        yield
        return
    from fedmq.coordinator.observers.tensorboard import TensorBoardScalars

    scalars = TensorBoardScalars(args.out / "tensorboard" if args.tensorboard is True else args.tensorboard)
    coordinator.watchers.append(scalars)
    try:
        yield
    finally:
        scalars.close()


@contextlib.asynccontextmanager
async def _http_api(args: argparse.Namespace, coordinator: Any, cfg: Any) -> AsyncIterator[None]:
    """The HTTP API and dashboard (`--http`) for as long as the coordinator serves."""
    if args.http is None:
        yield
        return
    import yaml

    from fedmq.coordinator.errors import CoordinatorError
    from fedmq.coordinator.observers.http import CoordinatorAPI, read_token
    from fedmq.coordinator.observers.metrics import CoordinatorMetrics

    try:
        token = read_token(args.http_token_file) if args.http_token_file else None
        metrics = CoordinatorMetrics.attach(coordinator)
        api = CoordinatorAPI(coordinator, config=yaml.safe_load(cfg.to_yaml()), token=token, metrics=metrics.render)
        url = await api.start(*args.http)
    except CoordinatorError as exc:
        raise ConfigError(str(exc)) from exc
    print(f"dashboard: {url}", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        await api.stop()


def _resume_or_start(out: Path) -> None:
    """`--resume` without a checkpoint starts from the beginning: the records of an attempt that
    stopped before its first checkpoint go, as on a resume those after the checkpoint do."""
    from fedmq.coordinator.storage.run_dir import CHECKPOINT, RunDir

    if not (out / CHECKPOINT).exists():
        logger.info("--resume: no checkpoint in %s yet; starting from the beginning", out)
        RunDir(out).truncate_metrics_after(-1)
