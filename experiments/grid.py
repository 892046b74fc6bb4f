"""Experiment grids: one file declares methods x settings x seeds, and `fedmq run` runs every cell.

    grid:                          # dotted config paths; a list of values, or a map label -> value
      nodes,fraction: {N=30: [30, 0.1], C=0.5: [100, 0.5]}   # paths set together, not crossed
      method:
        FedAvg: {name: fedavg}
        FedProx: {name: fedprox, hyperparams: {mu: 0.01}}
        KDIA:                      # a value may depend on another axis's label (lambda_gen per beta):
          name: kdia
          hyperparams: {lambda_gen: {per: partition.alpha, 0.1: 0.01, 0.5: 1.0, 5: 0.01}}
      partition.alpha: [0.1, 0.5, 5.0]
      seed: [0, 1, 2]
    report:
      rows: [method]               # axes whose labels make the table's rows
      average_over: [seed]         # axes averaged over (mean +- std); the other axes make the columns

Every cell is validated when the file is loaded, so a bad value fails before anything runs. A file
without `grid` is a grid of one cell.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedmq.experiments.config import (
    ExperimentConfig,
    apply_overrides,
    key_path,
    override_sources,
    parse_config,
    read_yaml_sourced,
    set_path,
)
from fedmq.experiments.yaml_source import SourceMap
from fedmq.fedcore.errors import ConfigError

_SAFE = re.compile(r"[^A-Za-z0-9_.=-]+")


def slug(text: str, limit: int = 80) -> str:
    """A file-system safe ASCII name: letters such as β become their names (beta), the rest '-'."""
    spelled = "".join(
        ch if ch.isascii() else (unicodedata.name(ch, "-").split()[-1].lower() if ch.isalpha() else "-") for ch in text
    )
    return _SAFE.sub("-", spelled).strip("-_")[:limit]


class ReportConfig(BaseModel):
    """How `report.md` lays out a grid's results, and the paper's figures to show beside ours."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: list[str] = Field(default_factory=lambda: ["method"], description="axes that make the rows")
    average_over: list[str] = Field(default_factory=lambda: ["seed"], description="axes averaged (mean +- std)")
    baseline: str | None = Field(None, description="row label whose best accuracy is the target, e.g. FedAvg")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="a fixed target instead of a baseline")
    paper_metric: Literal["best", "final", "last_mean", "ema"] = Field(
        "best", description="how the paper reports accuracy, so ours is computed the same way beside it"
    )
    last_k: int = Field(10, ge=1, description="rounds averaged by last_mean (FedSA: last 10 rounds)")
    ema: float = Field(0.9, gt=0, lt=1, description="smoothing of the ema metric (FedRCL: 0.9)")
    paper: dict[str, dict[str, float | str]] = Field(
        default_factory=dict, description="row label -> column label -> the paper's accuracy (%)"
    )
    paper_source: str | None = Field(None, description="where the paper's figures come from (table, page)")

    @field_validator("rows", "average_over")
    @classmethod
    def _paths(cls, value: list[str]) -> list[str]:
        for key in value:
            if not key or any(not part.isidentifier() for part in key.split(".")):
                raise ValueError(f"{key!r} is not a dotted config path")
        return value


@dataclass(frozen=True, slots=True)
class Axis:
    key: str
    labels: tuple[str, ...]
    values: tuple[Any, ...]
    explicit: bool = False
    """Labels given in the file (a map), shown as they are; otherwise shown as key=label."""


@dataclass(frozen=True, slots=True)
class Cell:
    index: int
    cell_id: str
    labels: dict[str, str]
    """Axis key -> the label of this cell's value."""
    config: ExperimentConfig


@dataclass(frozen=True, slots=True)
class Grid:
    name: str
    axes: tuple[Axis, ...]
    cells: tuple[Cell, ...]
    report: ReportConfig

    @property
    def is_grid(self) -> bool:
        return bool(self.axes)

    def describe(self) -> dict[str, Any]:
        """What `grid.json` records, enough for `fedmq report` to rebuild the report."""
        return {
            "name": self.name,
            "axes": [{"key": a.key, "labels": list(a.labels), "explicit": a.explicit} for a in self.axes],
            "cells": [
                {"index": c.index, "id": c.cell_id, "labels": c.labels, "method": c.config.method.name}
                for c in self.cells
            ],
            "report": self.report.model_dump(mode="json"),
        }


def _label(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        return value["name"]  # a method or model given as a map: its name
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _paths(key: Any) -> list[str]:
    """The config paths an axis sets: one (``partition.alpha``) or several together (``nodes,fraction``)."""
    paths = [k.strip() for k in key.split(",")] if isinstance(key, str) else []
    if not paths or any(not p or any(not part.isidentifier() for part in p.split(".")) for p in paths):
        raise ConfigError(f"grid: {key!r} is not a dotted config path such as partition.alpha (or paths joined by ',')")
    if any(p in ("grid", "report", "name") for p in paths):
        raise ConfigError(f"grid: {key!r} cannot vary across cells")
    return paths


def _located_axis(key: Any, spec: Any, sources: SourceMap) -> Axis:
    """`_axis`, its error led by the axis' file and line."""
    try:
        return _axis(key, spec)
    except ConfigError as exc:
        where = sources.where(("grid", key))
        raise (ConfigError(f"{where}: {exc}") if where else exc) from None


def _axis(key: Any, spec: Any) -> Axis:
    paths = _paths(key)
    explicit = isinstance(spec, dict)
    if isinstance(spec, dict):
        labels, values = tuple(str(k) for k in spec), tuple(spec.values())
    elif isinstance(spec, list):
        values = tuple(spec)
        labels = tuple(_label(v) for v in values)
    else:
        raise ConfigError(f"grid.{key}: give a list of values or a map of label to value, got {type(spec).__name__}")
    if not values:
        raise ConfigError(f"grid.{key}: no values")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"grid.{key}: labels {list(labels)} repeat; give a map of distinct labels to values")
    if len(paths) > 1 and any(not isinstance(v, list) or len(v) != len(paths) for v in values):
        raise ConfigError(f"grid.{key}: each value is a list of {len(paths)}, one per path, e.g. [100, 0.1]")
    return Axis(key, labels, values, explicit)


def cell_id(index: int, parts: dict[str, tuple[str, Any]]) -> str:
    """A short, file-system safe, stable directory name: 003-FedAvg_alpha=0.1_seed=2.

    `parts` maps each axis to (label, value): scalar values show as key=value, maps by their label.
    """
    words = []
    for key, (label, value) in parts.items():
        short = key.rsplit(".", 1)[-1]
        scalar = isinstance(value, int | float | str | bool) and not isinstance(value, dict)
        words.append(f"{short}={_label(value)}" if scalar else label)
    name = slug("_".join(words))
    return f"{index:03d}-{name}" if name else f"{index:03d}"


def expand(data: dict[str, Any], *, source: str = "config", sources: SourceMap | None = None) -> Grid:
    """Cells of a parsed experiment file; each cell's config is validated here. With `sources` (where
    the file's values were written: `read_yaml_sourced`) errors name the file and line."""
    data = dict(data)
    sources = sources or SourceMap()
    grid_spec = data.pop("grid", None) or {}
    report_spec = data.pop("report", None) or {}
    try:
        report = ReportConfig.model_validate(report_spec)
    except ValidationError as exc:
        spec = {"report": report_spec}
        lines = [sources.render(("report", *e["loc"]), e["msg"], spec) for e in exc.errors()]
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines)) from None
    if not isinstance(grid_spec, dict):
        raise ConfigError(
            f"{sources.where(('grid',)) or source}: grid must be a map of config paths to lists of values"
        )
    axes = tuple(_located_axis(k, v, sources) for k, v in grid_spec.items())
    keys = {a.key for a in axes}
    for name in ("rows", "average_over"):
        unknown = sorted(set(getattr(report, name)) - keys)
        if axes and unknown and name in report.model_fields_set:  # the defaults apply where the axes exist
            where = sources.where(("report", name)) or source
            raise ConfigError(f"{where}: report names axes {unknown} that the grid does not vary ({sorted(keys)})")
    cells = []
    for index, combo in enumerate(itertools.product(*(range(len(a.values)) for a in axes))):
        cell_data = copy.deepcopy(data)
        cell_sources = sources
        labels, parts = {}, {}
        for axis, i in zip(axes, combo, strict=True):
            paths = _paths(axis.key)
            values = axis.values[i] if len(paths) > 1 else [axis.values[i]]
            # the cell's value was written in the grid, at this label (a map) or position (a list)
            at = ("grid", axis.key, axis.labels[i] if axis.explicit else i)
            written = sources.where(at) or f"grid.{axis.key}"
            for path, value in zip(paths, values, strict=True):
                set_path(cell_data, path, copy.deepcopy(value), where=f"grid.{axis.key}")
                cell_sources = cell_sources.set(key_path(path), written)
            labels[axis.key] = axis.labels[i]
            parts[axis.key] = (axis.labels[i], axis.values[i])
        where = f"{source} (cell {', '.join(f'{k}={v}' for k, v in labels.items())})" if labels else source
        cell_data = _resolve_per_axis(cell_data, labels, where)
        config = parse_config(cell_data, source=where, sources=cell_sources)
        cells.append(Cell(index, cell_id(index, parts), labels, config))
    name = str(data.get("name", "experiment"))
    return Grid(name, axes, tuple(cells), report)


def _resolve_per_axis(value: Any, labels: dict[str, str], where: str) -> Any:
    """Replace every ``{per: AXIS, LABEL: value, ...}`` by the value for this cell's label on AXIS
    (a hyperparameter the paper sets per setting, such as KDIA's lambda_gen per beta)."""
    if isinstance(value, list):
        return [_resolve_per_axis(v, labels, where) for v in value]
    if not isinstance(value, dict):
        return value
    if "per" not in value:
        return {k: _resolve_per_axis(v, labels, where) for k, v in value.items()}
    axis = value["per"]
    choices = {str(k): v for k, v in value.items() if k != "per"}
    if axis not in labels:
        raise ConfigError(f"{where}: 'per: {axis}' names no grid axis; axes: {sorted(labels)}")
    if labels[axis] not in choices:
        raise ConfigError(f"{where}: 'per: {axis}' gives no value for {labels[axis]!r}; it has {sorted(choices)}")
    return _resolve_per_axis(choices[labels[axis]], labels, where)


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> Grid:
    """Read an experiment file (with or without a grid); `--set` overrides apply before expansion."""
    data, sources = read_yaml_sourced(path)
    if overrides:
        data = apply_overrides(data, overrides)
        sources = override_sources(sources, overrides)
    return expand(data, source=str(path), sources=sources)


def dump_cell_config(cell: Cell) -> str:
    return yaml.safe_dump(cell.config.model_dump(mode="json"), sort_keys=False)


def cell_is_done(directory: Path, cell: Cell) -> bool:
    """A cell finished before with the same config (its federation id aside) is not run again. The
    recorded config is compared as read, not as text: one written before a setting existed reads with
    its default, one in an older spelling as today's, so an upgrade does not re-run finished cells."""
    try:
        summary = json.loads((directory / "summary.json").read_text())
        previous = yaml.safe_load((directory / "config.yaml").read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False
    if summary.get("state") != "finished" or not isinstance(previous, dict):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # an older spelling: fedmq's own file, not the user's
            recorded = parse_config(previous, source=str(directory / "config.yaml"))
    except ConfigError:
        return False  # a setting it holds no longer exists, or is out of today's bounds: run it again
    unnamed = {"federation": None}
    return recorded.model_copy(update=unnamed) == cell.config.model_copy(update=unnamed)
