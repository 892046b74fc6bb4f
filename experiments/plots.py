"""Figures written into the run directory (matplotlib, Agg backend, imported only when drawing)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; must precede the pyplot import
    import matplotlib.pyplot as plt

    return plt


def _ticks(count: int, most: int) -> np.ndarray:
    """At most `most` evenly spaced integer positions in 0 .. count-1, on round numbers."""
    if count <= most:
        return np.arange(count)
    step = count / most
    magnitude = 10 ** math.floor(math.log10(step))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= step)
    return np.arange(0, count, step, dtype=int)


def partition_heatmap(
    path: str | Path,
    histogram: np.ndarray,
    *,
    title: str,
    node_labels: Sequence[str] | None = None,
    total_samples: int | None = None,
    dpi: int = 120,
) -> Path:
    """A PNG of a nodes x classes label histogram: counts on a log colour scale, node sizes above.

    Nodes run along the x axis in id order, classes up the y axis; a class a node does not hold
    is white. Sized so that 10 to 1,000 nodes and 10 to 200 classes stay readable.
    `total_samples` (the training set's size) shows how much of it the partition assigned.
    """
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    hist = np.asarray(histogram)
    if hist.ndim != 2 or hist.size == 0:
        raise ValueError(f"histogram must be a non-empty nodes x classes array, got shape {hist.shape}")
    nodes, classes = hist.shape
    sizes = hist.sum(axis=1)
    vmax = max(float(hist.max()), 10.0)  # counts from 1: the same colour means the same count in every run
    width = min(16.0, max(7.0, 2.5 + 0.16 * nodes))
    height = min(11.0, max(5.0, 2.2 + 0.09 * classes))

    fig = plt.figure(figsize=(width, height), dpi=dpi, layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 4), width_ratios=(60, 1))
    ax = fig.add_subplot(grid[1, 0])
    top = fig.add_subplot(grid[0, 0], sharex=ax)
    cax = fig.add_subplot(grid[1, 1])

    cmap = plt.get_cmap("viridis").with_extremes(bad="white")
    image = ax.imshow(
        np.ma.masked_equal(hist.T, 0),
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        cmap=cmap,
        norm=LogNorm(vmin=1.0, vmax=vmax),
        extent=(-0.5, nodes - 0.5, -0.5, classes - 0.5),
    )
    bar = fig.colorbar(image, cax=cax)
    bar.ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    bar.set_label("samples (log scale; white: 0)")

    ax.set_xticks(_ticks(nodes, 25))
    span = f"{node_labels[0]} .. {node_labels[-1]}" if node_labels is not None else f"0 .. {nodes - 1}"
    ax.set_xlabel(f"node, in id order ({nodes} nodes: {span})")
    ax.set_yticks(_ticks(classes, 20))
    ax.set_ylabel(f"class ({classes} classes)")

    top.bar(np.arange(nodes), sizes, width=1.0 if nodes > 100 else 0.8, color="#4c72b0", linewidth=0)
    top.set_ylabel("samples")
    top.tick_params(labelbottom=False)
    top.set_xlim(-0.5, nodes - 0.5)
    top.grid(axis="y", alpha=0.3)
    held = (hist > 0).sum(axis=1)
    of = f" of {total_samples}" if total_samples is not None else ""
    stats = (
        f"{int(sizes.sum())}{of} samples on {nodes} nodes; node size min {int(sizes.min())},"
        f" median {int(np.median(sizes))}, max {int(sizes.max())}; classes per node {int(held.min())}"
        + (f" to {int(held.max())}" if held.max() != held.min() else "")
    )
    chars = int(width * 11)  # about what fits at 10 pt
    top.set_title("\n".join(textwrap.wrap(title, chars) + textwrap.wrap(stats, chars)), fontsize=10, loc="left")

    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


def partition_png(path: str | Path, report: Mapping[str, Any]) -> Path:
    """The heat-map of a `experiments.build.partition_report` (partition.json) as a PNG."""
    hist = np.array(list(report["label_histograms"].values()), dtype=np.int64)
    params = ", ".join(f"{k}={v}" for k, v in report.get("parameters", {}).items() if v is not None)
    kind = f"{report['kind']}({params})" if params else str(report["kind"])
    return partition_heatmap(
        path,
        hist,
        title=f"partition {kind}, seed {report.get('seed', '?')}",
        node_labels=list(report["label_histograms"]),
        total_samples=report.get("train_samples"),
    )
