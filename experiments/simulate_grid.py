"""`fedmq simulate GRID.yaml --jobs N`: every cell of a grid simulated, N cells at a time.

A grid of seeds and methods is many independent federations; in simulation each is one process's
training and nothing else, so they run side by side in worker processes (spawned: each gets its own
torch, its own threads and, with ``--device cuda``, its own CUDA context on the shared GPU). The
run directory is a grid's, as `fedmq run` writes it (`grid.json`, `cells/NNN-*/`, `report.md`), and
finished cells are kept, so the same command resumes an interrupted grid; with ``--resume`` a cell
cut off goes on from its last checkpoint instead of starting again.

With ``--cells-per-process K`` each worker process simulates K cells at once, one thread each, and on
a GPU each thread on a CUDA stream of its own (`cell_stream`). Processes on one GPU take turns on it
(time slices, without NVIDIA's MPS), while the streams of one process run their kernels side by side:
the papers' small models leave most of the GPU idle in each kernel, so cells sharing a process can
fill it. A cell computes what it computes alone, on its own stream, so its results are bitwise those
of one cell a process; its host work (the engine, each round's plan) takes turns with the others'
under Python's GIL. What draws from torch's process-wide random stream, a model's initialisation,
does so one thread at a time (`fedcore.seeding.global_stream`); a model of a user's whose training
draws from it (dropout: no built-in model has any) would make the cells of a process depend on each
other, so such a grid keeps one cell a process.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from rich.console import Console

from fedmq.coordinator.storage.run_dir import CHECKPOINT, write_json
from fedmq.experiments.build import preflight
from fedmq.experiments.cli.exits import EXIT_FAILED, EXIT_OK
from fedmq.experiments.grid import Cell, Grid, cell_is_done
from fedmq.experiments.report import time_shares, write_report
from fedmq.experiments.sim_checkpoint import ResumeError, resume_refusal
from fedmq.experiments.simulate import made_by_another
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.seeding import global_stream_layer


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


@contextlib.contextmanager
def cell_stream(device: str | None) -> Iterator[None]:
    """On a CUDA device, the calling thread's work on a CUDA stream of its own (a thread's current stream
    is its own setting); elsewhere nothing."""
    import torch

    if device is None or torch.device(device).type != "cuda":
        yield
        return
    with torch.cuda.stream(torch.cuda.Stream(torch.device(device))):
        yield


def simulate_cells(
    configs: Sequence[dict[str, Any]], outs: Sequence[str], device: str | None, threads: int, resume: bool = False
) -> list[dict[str, Any]]:
    """Several cells in one worker process, a thread each (`cell_stream`): each cell's summary, or
    ``{"error": ...}`` for a cell that raised (the others go on)."""
    results: list[dict[str, Any]] = [{"error": "did not run"} for _ in configs]

    def one(i: int) -> None:
        try:
            with cell_stream(device):
                results[i] = simulate_cell(configs[i], outs[i], device, threads, resume)
        except Exception as exc:  # reported with the cell; the process and its other cells go on
            results[i] = {"error": repr(exc)}

    workers = [threading.Thread(target=one, args=(i,), name=f"cell-{i}") for i in range(len(configs))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def resumable(directory: Path, cell: Cell) -> bool:
    """A cell cut off after a checkpoint of the same experiment: `--resume` continues it."""
    return (directory / CHECKPOINT).exists() and not made_by_another(directory, cell.config)


def _finished_runs(roots: Sequence[Path]) -> list[Path]:
    """The run directories under `roots` that finished: each root itself (a single run) or its grid's
    cells (ROOT/cells/*). A root that is neither is an error: a mistyped path would otherwise copy nothing."""
    found: list[Path] = []
    for root in roots:
        runs = [root] if (root / "summary.json").exists() else sorted((root / "cells").glob("*/"))
        if not runs:
            raise ConfigError(f"--cells-from {root}: neither a run directory nor a grid's (no summary.json, no cells/)")
        found += [run for run in runs if (run / "summary.json").exists()]
    return found


def simulate_grid(
    grid: Grid,
    out: Path,
    *,
    jobs: int,
    device: str | None,
    threads: int,
    console: Console | None = None,
    resume: bool = False,
    cells_per_process: int = 1,
    cells_from: Sequence[Path] = (),
) -> int:
    """Simulate every cell not finished before, `jobs` processes at a time, each simulating
    `cells_per_process` cells at once (threads); write the grid's report. With `resume`, a cell cut off
    goes on from its checkpoint instead of starting again. `cells_from`: run directories of other grids
    (or single runs), whose finished cells of the same experiment as one of this grid's are copied in
    instead of run again (a baseline run once for several grids)."""
    if cells_per_process < 1:
        raise ValueError(f"cells_per_process must be at least 1, not {cells_per_process}")
    console = console or Console(highlight=False, soft_wrap=True)
    choices = {cell.config.simulation.cudnn for cell in grid.cells}
    if cells_per_process > 1 and len(choices) > 1:
        raise ConfigError(
            f"--cells-per-process {cells_per_process}: the cells ask for different simulation.cudnn"
            f" ({', '.join(sorted(choices))}), and cuDNN's choice holds for a whole process."
            " Run the grid with --cells-per-process 1 (--jobs N still runs cells side by side)"
        )
    for cell in grid.cells:  # a bad cell (missing data, say) fails now, not an hour into the grid
        model = preflight(cell.config)
        drawing = global_stream_layer(model) if cells_per_process > 1 else None
        if drawing is not None:
            raise ConfigError(
                f"--cells-per-process {cells_per_process}: cell {cell.cell_id}'s model {cell.config.model.name!r}:"
                f" {drawing}, which draws from torch's global random stream while training: cells sharing a"
                " process would draw from one stream, and a cell's results would depend on the others'."
                " Run its grid with --cells-per-process 1 (--jobs N still runs cells side by side)"
            )
        refusal = resume_refusal(cell.config) if resume else None
        if refusal is not None:
            raise ResumeError(f"--resume: cell {cell.cell_id}: {refusal}")
    (out / "cells").mkdir(parents=True, exist_ok=True)
    write_json(out / "grid.json", grid.describe())
    todo: list[Cell] = []
    elsewhere = _finished_runs(cells_from)
    for cell in grid.cells:
        directory = out / "cells" / cell.cell_id
        if cell_is_done(directory, cell):
            console.print(f"[dim]{cell.cell_id}: finished before, kept[/]")
            continue
        found = next((d for d in elsewhere if cell_is_done(d, cell)), None)
        if found is not None:
            if directory.exists():
                shutil.rmtree(directory)
            shutil.copytree(found, directory)
            console.print(f"[dim]{cell.cell_id}: finished in {found}, copied[/]")
            continue
        if resume and resumable(directory, cell):
            console.print(f"[dim]{cell.cell_id}: cut off before; resumed from its checkpoint[/]")
        elif directory.exists():
            shutil.rmtree(directory)
        todo.append(cell)
    per = cells_per_process
    at_once = min(jobs * per, len(todo) or 1)
    how = f" ({per} a process)" if per > 1 else ""
    console.print(f"{len(todo)} of {len(grid.cells)} cells to simulate, {at_once} at a time{how}")
    failed: list[str] = []
    started = time.monotonic()
    done = 0
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=get_context("spawn")) as pool:
        futures: dict[Future[list[dict[str, Any]]], list[Cell]] = {}
        for first in range(0, len(todo), per):
            batch = todo[first : first + per]
            configs = [c.config.model_dump(mode="json") for c in batch]
            outs = [str(out / "cells" / c.cell_id) for c in batch]
            futures[pool.submit(simulate_cells, configs, outs, device, threads, resume)] = batch
        for future in as_completed(futures):
            batch = futures[future]
            try:
                summaries = future.result()
            except Exception as exc:  # the process itself failed (killed, out of memory): its cells did
                summaries = [{"error": repr(exc)} for _ in batch]
            for cell, summary in zip(batch, summaries, strict=True):
                done += 1
                elapsed = (time.monotonic() - started) / 60
                _report(console, cell, summary, f"{done}/{len(todo)}", elapsed, failed)
    try:
        console.print(f"report: {write_report(out)}")
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[yellow]could not write the report: {exc}[/]")
    if failed:
        console.print(f"[red]{len(failed)} cell(s) failed: {', '.join(failed)}; run again to retry them[/]")
        return EXIT_FAILED
    return EXIT_OK


def _report(
    console: Console, cell: Cell, summary: dict[str, Any], count: str, elapsed: float, failed: list[str]
) -> None:
    """One cell's line as it finishes; a cell that failed or did not finish goes to `failed`."""
    what = ", ".join(f"{k}={v}" for k, v in cell.labels.items())
    if "error" in summary:  # one cell's failure is reported; the others go on
        failed.append(cell.cell_id)
        console.print(f"[red]{count} {cell.cell_id} ({what}) failed: {summary['error']}[/]")
        return
    if summary.get("state") != "finished":
        failed.append(cell.cell_id)
    accuracy = summary.get("final_accuracy")
    shown = f"{accuracy:.4f}" if isinstance(accuracy, float) else "n/a"
    shares = time_shares(summary)
    took = f"{summary.get('wall_seconds', 0):.0f} s" + (f" ({shares})" if shares else "")
    console.print(
        f"{count} {cell.cell_id} ({what}): {summary.get('state')}, final accuracy {shown}, {took};"
        f" {elapsed:.1f} min into the grid"
    )
