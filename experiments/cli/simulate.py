"""`fedmq simulate`: the federation in one process on a virtual clock, under a scenario, for one
experiment or every cell of a grid (`experiments.simulate`, `experiments.simulate_grid`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.cli.options import add_experiment, add_out, add_threads, device, positive_int, set_threads
from fedmq.fedcore.errors import ConfigError

if TYPE_CHECKING:
    from fedmq.experiments.yaml_source import SourceMap


HELP = "run a federation in one process on a virtual clock, under a scenario"
DESCRIPTION = (
    "The same engine, methods, data and seeds as `fedmq run`, with no broker and no sleeping:"
    " node availability, compute and link times and dropped tasks come from the scenario (the"
    " experiment's `scenario:` or --scenario), so hours of a federation run in the time its training"
    " takes. Writes a run directory with events.jsonl, which `fedmq replay` can check."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_experiment(p, positional=True)
    p.add_argument("--scenario", type=Path, metavar="FILE", help="a scenario file (replaces the experiment's)")
    add_out(p, "run directory (default: runs/NAME-sim-TIMESTAMP)")
    p.add_argument("--device", type=device, help="torch device (default: cuda when present, else cpu)")
    add_threads(p, "torch threads (default 1)", default=1)
    p.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="for a grid: cells simulated at once, each in a process of its own (default 1); with a GPU,"
        " several cells share it",
    )
    p.add_argument(
        "--cells-per-process",
        type=positive_int,
        default=1,
        metavar="K",
        help="for a grid: cells each of the --jobs processes simulates at once, a thread each (default 1);"
        " with a GPU, each on a CUDA stream of its own, so that their small kernels run side by side where"
        " processes take turns; each cell's results are bitwise those it has alone (a model of your own with"
        " dropout, which draws from torch's global random stream while training, is refused)",
    )
    p.add_argument(
        "--cells-from",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="for a grid: a run directory of another grid (or one run) whose finished cells of the same"
        " experiment as one of this grid's are copied in instead of simulated again; repeatable",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its last checkpoint (simulation.checkpoint_every), ending as an"
        " uncut run would; without one yet, start from the beginning; a finished run or grid cell is not run"
        " again",
    )


def run(args: argparse.Namespace) -> int:
    import json
    from datetime import datetime

    import torch

    from fedmq.experiments.config import parse_config, read_yaml_sourced
    from fedmq.experiments.simulate import simulate

    data, sources = read_yaml_sourced(args.config)
    if args.overrides:
        from fedmq.experiments.config import apply_overrides, override_sources

        data = apply_overrides(data, args.overrides)
        sources = override_sources(sources, args.overrides)
    if args.scenario is not None:
        from fedmq.experiments.scenario import resolve_scenario_sourced

        data["scenario"], scenario_sources = resolve_scenario_sourced(str(args.scenario), Path.cwd())
        # the file given replaces the experiment's scenario: its lines, or else the option, name its values
        sources = scenario_sources.mounted(("scenario",)).over(
            sources.set(("scenario",), f"--scenario {args.scenario}")
        )
    if args.resume and args.out is None:
        raise ConfigError("--resume needs --out DIR: the run directory to continue")
    if "grid" in data:
        return _grid(args, data, sources)
    if args.cells_from:
        raise ConfigError(f"--cells-from is for a grid, and {args.config} has none")
    cfg = parse_config(data, source=str(args.config), sources=sources)
    set_threads(args.threads)
    out = args.out or Path("runs") / f"{cfg.name}-sim-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    summary = simulate(cfg, out, device=torch.device(args.device) if args.device else None, resume=args.resume)
    keys = (
        "state",
        "final_accuracy",
        "simulated_seconds",
        "wall_seconds",
        "simulated_per_wall_second",
        "wall_seconds_by_part",
    )
    print(json.dumps({k: summary.get(k) for k in keys} | {"out": str(out)}, indent=2))
    return EXIT_OK if summary["state"] == "finished" else EXIT_FAILED


def _grid(args: argparse.Namespace, data: dict[str, Any], sources: SourceMap) -> int:
    from datetime import datetime

    from fedmq.experiments.grid import expand
    from fedmq.experiments.simulate_grid import simulate_grid

    grid = expand(data, source=str(args.config), sources=sources)
    first = grid.cells[0].config
    out = args.out or Path("runs") / f"{first.name}-sim-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    return simulate_grid(
        grid,
        out,
        jobs=args.jobs,
        device=args.device,
        threads=args.threads,
        resume=args.resume,
        cells_per_process=args.cells_per_process,
        cells_from=args.cells_from,
    )
