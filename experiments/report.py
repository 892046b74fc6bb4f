"""The report of a run directory: the papers' tables and curves, rebuilt from the saved metrics.

`report.md` holds final and best accuracy as mean +- std over seeds (one row per method, one
column per setting), the rounds each method needs to reach a target (the papers' "rounds to
FedAvg's best"), the paper's figure beside ours where the experiment file gives it, accuracy-by-round
curves as PNGs, and a table of every cell. `report.json` holds the same numbers for programs.
Works on a grid's directory (`grid.json` + `cells/*/`) and on a single run's directory.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from fedmq.coordinator.storage.run_dir import write_json
from fedmq.experiments.grid import ReportConfig, slug

logger = logging.getLogger(__name__)

METRICS = ("best", "final", "last_mean", "ema")


@dataclass(frozen=True, slots=True)
class CellResult:
    cell_id: str
    labels: dict[str, str]
    method: str
    """The method's name, the row label when the grid does not vary the method."""
    state: str
    rounds_completed: int
    wall_seconds: float | None
    curve: tuple[tuple[int, float], ...]
    """(round, test accuracy) at every evaluated round, in order."""
    others: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    """The curves of the run's other evaluated models (KDIA's teacher), by name."""
    time_by_part: str = ""
    """Where its wall time went (`time_shares` of its summary), or "" for a run from before the parts."""

    def metric(self, name: str, cfg: ReportConfig) -> float | None:
        accs = [a for _, a in self.curve]
        if not accs:
            return None
        if name == "best":
            return max(accs)
        if name == "final":
            return accs[-1]
        if name == "last_mean":
            tail = accs[-cfg.last_k :]
            return sum(tail) / len(tail)
        value = accs[0]  # ema, as FedRCL smooths its curves
        for a in accs[1:]:
            value = cfg.ema * value + (1 - cfg.ema) * a
        return value


@dataclass(frozen=True, slots=True)
class Stat:
    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / len(self.values)

    @property
    def std(self) -> float:
        """Population standard deviation (numpy's default, as the papers' code computes it)."""
        m = self.mean
        return math.sqrt(sum((v - m) ** 2 for v in self.values) / len(self.values))

    def as_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "n": self.n, "values": list(self.values)}


@dataclass
class ReportData:
    name: str
    config: ReportConfig
    rows: list[str]
    columns: list[str]
    cells: list[CellResult]
    groups: dict[tuple[str, str], list[CellResult]] = field(default_factory=dict)

    def stat(self, metric: str, row: str, column: str) -> Stat | None:
        values = [v for c in self.groups.get((row, column), []) if (v := c.metric(metric, self.config)) is not None]
        return Stat(tuple(values)) if values else None

    def mean_curve(self, row: str, column: str) -> list[tuple[int, float]]:
        """Accuracy by round averaged over the group's cells, at the rounds every cell evaluated."""
        curves = [dict(c.curve) for c in self.groups.get((row, column), []) if c.curve]
        if not curves:
            return []
        rounds = sorted(set.intersection(*(set(c) for c in curves)))
        return [(r, sum(c[r] for c in curves) / len(curves)) for r in rounds]

    def target(self, column: str) -> float | None:
        """A fixed target, or the baseline's best accuracy on its seed-averaged curve."""
        if self.config.target_accuracy is not None:
            return self.config.target_accuracy
        if self.config.baseline is None:
            return None
        curve = self.mean_curve(self.config.baseline, column)
        return max(a for _, a in curve) if curve else None

    def rounds_to_target(self, row: str, column: str) -> int | None:
        """Rounds until the seed-averaged accuracy first reached the column's target (round index + 1)."""
        target = self.target(column)
        if target is None:
            return None
        return next((r + 1 for r, a in self.mean_curve(row, column) if a >= target - 1e-12), None)


# -- loading ---------------------------------------------------------------------------------


def read_curves(metrics_path: Path) -> dict[str, tuple[tuple[int, float], ...]]:
    """Per evaluated model, (round, test accuracy) at its evaluated rounds: ``""`` is the first model
    (``accuracy``), other names come from ``accuracy_<name>`` (KDIA's teacher). A retried round counts
    once, at its aggregated attempt."""
    if not metrics_path.exists():
        return {}
    curves: dict[str, dict[int, float]] = {}
    for line in metrics_path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("%s: skipped a line that is not JSON (a run cut off while writing?)", metrics_path)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("round"), int):
            continue
        for key, value in record.items():
            if (key == "accuracy" or key.startswith("accuracy_")) and isinstance(value, int | float):
                curves.setdefault(key.removeprefix("accuracy").removeprefix("_"), {})[record["round"]] = float(value)
    return {name: tuple(sorted(points.items())) for name, points in sorted(curves.items())}


def load_cell(directory: Path, cell_id: str, labels: dict[str, str], method: str) -> CellResult:
    curves = read_curves(directory / "metrics.jsonl")
    summary: dict[str, Any] = {}
    path = directory / "summary.json"
    if path.exists():
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            logger.warning("%s is not valid JSON; the cell is reported as not run", path)
    return CellResult(
        cell_id=cell_id,
        labels=labels,
        method=method,
        state=str(summary.get("state", "not run")),
        rounds_completed=int(summary.get("rounds_completed", 0) or 0),
        wall_seconds=summary.get("wall_seconds"),
        curve=curves.get("", ()),
        others=tuple((name, curve) for name, curve in curves.items() if name),
        time_by_part=time_shares(summary),
    )


def time_shares(summary: dict[str, Any]) -> str:
    """A run's wall time by part as shares, the largest first ("60% training, 30% evaluation, 10%
    other", from `fedmq simulate`'s `wall_seconds_by_part`); "" for a summary without the parts."""
    parts, wall = summary.get("wall_seconds_by_part"), summary.get("wall_seconds")
    if not isinstance(parts, dict) or not isinstance(wall, int | float) or wall <= 0:
        return ""
    shares = sorted(((float(s) / wall, name) for name, s in parts.items() if s), reverse=True)
    return ", ".join(f"{share:.0%} {name}" for share, name in shares)


def load(run_dir: Path) -> ReportData:
    """The results under `run_dir`, grouped into the report's rows and columns."""
    grid_path = run_dir / "grid.json"
    if grid_path.exists():
        grid = json.loads(grid_path.read_text())
        config = ReportConfig.model_validate(grid.get("report") or {})
        cells = [
            load_cell(run_dir / "cells" / c["id"], c["id"], c["labels"], c.get("method", "run")) for c in grid["cells"]
        ]
        name = grid.get("name", run_dir.name)
        axes = [a["key"] for a in grid["axes"]]
        explicit = {a["key"] for a in grid["axes"] if a.get("explicit")}
    elif (run_dir / "summary.json").exists() or (run_dir / "metrics.jsonl").exists():
        config = ReportConfig()
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
        method = str(summary.get("method", "run"))
        cells = [load_cell(run_dir, run_dir.name, {}, method)]
        name = str(summary.get("experiment", run_dir.name))
        axes = []
        explicit = set()
    else:
        raise FileNotFoundError(f"{run_dir} holds neither grid.json nor a run's summary.json / metrics.jsonl")
    row_axes = [a for a in axes if a in config.rows]
    col_axes = [a for a in axes if a not in config.rows and a not in config.average_over]

    def key(cell: CellResult, which: Sequence[str], *, bare: bool) -> str:
        """Labels of `which` axes: as given when explicit (or bare), else as short-key=label."""
        return ", ".join(
            cell.labels[a] if bare or a in explicit else f"{a.rsplit('.', 1)[-1]}={cell.labels[a]}" for a in which
        )

    data = ReportData(name, config, [], [], cells)
    for cell in cells:
        row = key(cell, row_axes, bare=len(row_axes) == 1) or cell.method
        column = key(cell, col_axes, bare=False) or "all"
        # a run's other evaluated models (KDIA's teacher) get their own row: "KDIA (teacher)"
        variants = [(row, cell)] + [(f"{row} ({name})", replace(cell, curve=c, others=())) for name, c in cell.others]
        for label, result in variants:
            data.groups.setdefault((label, column), []).append(result)
            if label not in data.rows:
                data.rows.append(label)
        if column not in data.columns:
            data.columns.append(column)
    return data


# -- writing ---------------------------------------------------------------------------------


def _pct(stat: Stat | None) -> str:
    if stat is None:
        return "n/a"
    return f"{100 * stat.mean:.2f} ± {100 * stat.std:.2f}" if stat.n > 1 else f"{100 * stat.mean:.2f}"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _paper_cell(value: float | str | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float | int) else str(value)


def _rounds(data: ReportData, row: str, column: str) -> str:
    if data.target(column) is None:
        return "n/a"
    rounds = data.rounds_to_target(row, column)
    if rounds is None:
        last = data.mean_curve(row, column)
        return f"not within {last[-1][0] + 1}" if last else "n/a"
    base = data.rounds_to_target(data.config.baseline, column) if data.config.baseline else None
    speedup = f" ({base / rounds:.2f}x)" if base is not None and row != data.config.baseline else ""
    return f"{rounds}{speedup}"


def plot_curves(data: ReportData, run_dir: Path) -> list[tuple[str, str]]:
    """One PNG per column: mean accuracy by round per row, shaded between the seeds' min and max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    written = []
    for column in data.columns:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        drawn = False
        for i, row in enumerate(data.rows):
            mean = data.mean_curve(row, column)
            if not mean:
                continue
            xs = [r + 1 for r, _ in mean]
            # beyond the ten colours of the cycle, a new line style keeps every method distinct
            style = ("-", "--", ":", "-.")[(i // 10) % 4]
            (line,) = ax.plot(xs, [100 * a for _, a in mean], label=row, linewidth=1.6, linestyle=style)
            per = [dict(c.curve) for c in data.groups[(row, column)] if c.curve]
            if len(per) > 1:
                lo = [100 * min(p[r] for p in per) for r, _ in mean]
                hi = [100 * max(p[r] for p in per) for r, _ in mean]
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
            drawn = True
        target = data.target(column)
        if target is not None:
            ax.axhline(100 * target, color="grey", linestyle="--", linewidth=0.8, label="target")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{data.name}: {column}" if column != "all" else data.name)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="lower right", fontsize=8, ncols=2 if len(data.rows) > 8 else 1)
        name = f"curves-{slug(column) or 'all'}.png"
        fig.tight_layout()
        fig.savefig(run_dir / name)
        plt.close(fig)
        written.append((column, name))
    return written


def render(data: ReportData, plots: Sequence[tuple[str, str]]) -> str:
    cfg = data.config
    seeds = ", ".join(cfg.average_over) or "nothing"
    finished = sum(c.state == "finished" for c in data.cells)
    out = [
        f"# {data.name}",
        "",
        f"{len(data.cells)} cell(s), {finished} finished. Accuracy on the test set in %, mean ± std (population)"
        f" over {seeds}. Generated by `fedmq report` on {datetime.now().isoformat(timespec='seconds')}.",
        "",
    ]
    tables = (
        ("best", "Best accuracy (over all evaluated rounds)"),
        ("final", "Final accuracy"),
        ("last_mean", f"Mean accuracy of the last {cfg.last_k} evaluated rounds"),
    )
    for metric, title in tables:
        out += [f"## {title}", ""]
        rows = [[r, *(_pct(data.stat(metric, r, c)) for c in data.columns)] for r in data.rows]
        out += _table(["method", *data.columns], rows)
        out.append("")
    if cfg.paper:
        label = {
            "best": "best",
            "final": "final",
            "last_mean": f"mean of the last {cfg.last_k}",
            "ema": f"EMA {cfg.ema}",
        }
        out += [f"## Beside the paper ({label[cfg.paper_metric]} accuracy, as the paper reports it)", ""]
        if cfg.paper_source:
            out += [f"Paper figures: {cfg.paper_source}.", ""]
        header = ["method"] + [f"{c} {who}" for c in data.columns for who in ("ours", "paper")]
        rows = []
        for r in [*data.rows, *(r for r in cfg.paper if r not in data.rows)]:  # the paper's other methods too
            cells = []
            for c in data.columns:
                cells += [_pct(data.stat(cfg.paper_metric, r, c)), _paper_cell(cfg.paper.get(r, {}).get(c))]
            rows.append([r, *cells])
        out += _table(header, rows)
        out.append("")
    if cfg.baseline is not None or cfg.target_accuracy is not None:
        what = f"{cfg.baseline}'s best accuracy" if cfg.target_accuracy is None else f"{100 * cfg.target_accuracy:.2f}%"
        out += [
            f"## Rounds to reach {what}",
            "",
            "On the seed-averaged accuracy curve; speed-up over the baseline in brackets.",
            "",
        ]
        targets = ["target", *(_pct(Stat((t,))) if (t := data.target(c)) is not None else "n/a" for c in data.columns)]
        rows = [[r, *(_rounds(data, r, c) for c in data.columns)] for r in data.rows]
        out += _table(["method", *data.columns], [targets, *rows])
        out.append("")
    if plots:
        out += ["## Accuracy by round", ""]
        out += [f"![{column}]({name})" for column, name in plots]
        out.append("")
    out += ["## Cells", ""]
    out += _table(
        ["cell", "state", "rounds", "final", "best", "wall s", "where the time went"],
        (
            [
                c.cell_id,
                c.state,
                str(c.rounds_completed),
                _pct(Stat((v,))) if (v := c.metric("final", cfg)) is not None else "n/a",
                _pct(Stat((v,))) if (v := c.metric("best", cfg)) is not None else "n/a",
                f"{c.wall_seconds:.1f}" if isinstance(c.wall_seconds, int | float) else "n/a",
                c.time_by_part,
            ]
            for c in data.cells
        ),
    )
    return "\n".join(out) + "\n"


def as_json(data: ReportData) -> dict[str, Any]:
    def table(metric: str) -> dict[str, dict[str, Any]]:
        return {
            r: {c: (s.as_dict() if (s := data.stat(metric, r, c)) else None) for c in data.columns} for r in data.rows
        }

    rounds = {
        r: {c: {"target": data.target(c), "rounds": data.rounds_to_target(r, c)} for c in data.columns}
        for r in data.rows
    }
    return {
        "name": data.name,
        "rows": data.rows,
        "columns": data.columns,
        "tables": {m: table(m) for m in METRICS},
        "rounds_to_target": rounds,
        "paper": data.config.paper,
        "cells": [
            {
                "id": c.cell_id,
                "labels": c.labels,
                "state": c.state,
                "rounds_completed": c.rounds_completed,
                "final": c.metric("final", data.config),
                "best": c.metric("best", data.config),
            }
            for c in data.cells
        ],
    }


def write_report(run_dir: Path, *, plots: bool = True) -> Path:
    """Write report.md, report.json and the curves into `run_dir`; returns the report's path."""
    data = load(run_dir)
    written = plot_curves(data, run_dir) if plots else []
    path = run_dir / "report.md"
    path.write_text(render(data, written))
    write_json(run_dir / "report.json", as_json(data))
    return path
