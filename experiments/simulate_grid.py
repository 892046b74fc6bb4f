"""`fedmq simulate GRID.yaml --jobs N`: every cell of a grid simulated, N cells at a time.

A grid of seeds and methods is many independent federations; in simulation each is one process's
training and nothing else, so they run side by side in worker processes (spawned: each gets its own
torch, its own threads and, with ``--device cuda``, its own CUDA context on the shared GPU). The
run directory is a grid's, as `fedmq run` writes it (`grid.json`, `cells/NNN-*/`, `report.md`), and
finished cells are kept, so the same command resumes an interrupted grid; with ``--resume`` a cell
cut off goes on from its last checkpoint instead of starting again.
"""

from __future__ import annotations

import io
import shutil
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console

from fedmq.coordinator.storage.run_dir import CHECKPOINT, write_json
from fedmq.experiments.build import preflight
from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.grid import Cell, Grid, cell_is_done
from fedmq.experiments.report import write_report
from fedmq.experiments.sim_checkpoint import ResumeError, resume_refusal
from fedmq.experiments.simulate import made_by_another


def simulate_cell(
    config: dict[str, Any], out: str, device: str | None, threads: int, resume: bool = False
) -> dict[str, Any]:
    """One cell in a worker process: the config as its JSON dump (what crosses the process boundary);
    with `resume`, from the cell's checkpoint."""
    import torch

    from fedmq.experiments.config import parse_config
    from fedmq.experiments.simulate import simulate

    torch.set_num_threads(threads)
    cfg = parse_config(config, source=out)
    quiet = Console(file=io.StringIO())  # not a terminal: no progress bar from a worker
    return simulate(cfg, Path(out), device=torch.device(device) if device else None, console=quiet, resume=resume)


def resumable(directory: Path, cell: Cell) -> bool:
    """A cell cut off after a checkpoint of the same experiment: `--resume` continues it."""
    return (directory / CHECKPOINT).exists() and not made_by_another(directory, cell.config)


def simulate_grid(
    grid: Grid,
    out: Path,
    *,
    jobs: int,
    device: str | None,
    threads: int,
    console: Console | None = None,
    resume: bool = False,
) -> int:
    """Simulate every cell not finished before, `jobs` at a time; write the grid's report. With
    `resume`, a cell cut off goes on from its checkpoint instead of starting again."""
    console = console or Console(highlight=False, soft_wrap=True)
    for cell in grid.cells:  # a bad cell (missing data, say) fails now, not an hour into the grid
        preflight(cell.config)
        refusal = resume_refusal(cell.config) if resume else None
        if refusal is not None:
            raise ResumeError(f"--resume: cell {cell.cell_id}: {refusal}")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    write_json(out / "grid.json", grid.describe())
    todo: list[Cell] = []
    for cell in grid.cells:
        directory = out / "cells" / cell.cell_id
        if cell_is_done(directory, cell):
            console.print(f"[dim]{cell.cell_id}: finished before, kept[/]")
            continue
        if resume and resumable(directory, cell):
            console.print(f"[dim]{cell.cell_id}: cut off before; resumed from its checkpoint[/]")
        elif directory.exists():
            shutil.rmtree(directory)
        todo.append(cell)
    console.print(f"{len(todo)} of {len(grid.cells)} cells to simulate, {min(jobs, len(todo) or 1)} at a time")
    failed: list[str] = []
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
        futures: dict[Future[dict[str, Any]], Cell] = {
            pool.submit(
                simulate_cell, c.config.model_dump(mode="json"), str(out / "cells" / c.cell_id), device, threads, resume
            ): c
            for c in todo
        }
        for done, future in enumerate(as_completed(futures), 1):
            cell = futures[future]
            what = ", ".join(f"{k}={v}" for k, v in cell.labels.items())
            elapsed = (time.monotonic() - started) / 60
            try:
                summary = future.result()
            except Exception as exc:  # one cell's failure is reported; the others go on
                failed.append(cell.cell_id)
                console.print(f"[red]{done}/{len(todo)} {cell.cell_id} ({what}) failed: {exc!r}[/]")
                continue
            if summary.get("state") != "finished":
                failed.append(cell.cell_id)
            accuracy = summary.get("final_accuracy")
            shown = f"{accuracy:.4f}" if isinstance(accuracy, float) else "n/a"
            console.print(
                f"{done}/{len(todo)} {cell.cell_id} ({what}): {summary.get('state')}, final accuracy {shown},"
                f" {summary.get('wall_seconds', 0):.0f} s; {elapsed:.1f} min into the grid"
            )
    try:
        console.print(f"report: {write_report(out)}")
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[yellow]could not write the report: {exc}[/]")
    if failed:
        console.print(f"[red]{len(failed)} cell(s) failed: {', '.join(failed)}; run again to retry them[/]")
        return EXIT_FAILED
    return EXIT_OK
