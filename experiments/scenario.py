"""Scenario files: what happens to the nodes over time (availability, speed, links, failures), seeded.

A scenario is a YAML mapping, referenced from an experiment (``scenario: FILE``, relative to the
experiment file) or written inline under ``scenario:``. `expand` turns it, with the run's seed, into
one `fednode.scenario.NodeScript` per node, which the node daemon and the in-process simulation both
play. The format is documented in docs/scenarios.md; errors name the file and the line.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fedmq.experiments.yaml_source import Loc, SourceMap, dotted, read_yaml_file
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.seeding import seed_sequence, stream
from fedmq.fednode.scenario import NodeScript, Transition

MAX_TRANSITIONS = 100_000
"""Per node: a scenario whose on/off process or repeated windows would script more is refused."""

TRACE_EVENTS = ("online", "offline", "crash", "speed", "bandwidth", "latency")
"""Trace events: the first three move the node's availability; the others set a value for the run."""


class _Strict(BaseModel):
    """Unknown fields are errors; a dump leaves out what is unset (None), so saved configs stay short."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> Any:
        data: dict[str, Any] = handler(self)
        return {key: value for key, value in data.items() if value is not None}


# -- distributions ---------------------------------------------------------------------------------


class Exponential(_Strict):
    mean: float = Field(..., gt=0, allow_inf_nan=False)


class LogNormal(_Strict):
    """exp(N(mu, sigma^2)); give `mu` or the `median` (= exp(mu))."""

    mu: float | None = Field(None, allow_inf_nan=False)
    median: float | None = Field(None, gt=0, allow_inf_nan=False)
    sigma: float = Field(..., ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_centre(self) -> LogNormal:
        if (self.mu is None) == (self.median is None):
            raise ValueError("give mu or median (one of them)")
        return self

    @property
    def log_centre(self) -> float:
        return self.mu if self.mu is not None else math.log(self.median or 1.0)


class Pareto(_Strict):
    """Classical Pareto: values from `scale` up, P(X > x) = (scale / x)^alpha."""

    alpha: float = Field(..., gt=0, allow_inf_nan=False)
    scale: float = Field(1.0, gt=0, allow_inf_nan=False)


class Uniform(_Strict):
    low: float = Field(..., allow_inf_nan=False)
    high: float = Field(..., allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high < self.low:
            raise ValueError(f"high {self.high} is below low {self.low}")
        return self


def _invalid(message: str, *at: str | int, kind: str = "scenario") -> PydanticCustomError:
    """A validation error with a final message; `at` points deeper than the validator's own field
    (for the line number)."""
    return PydanticCustomError(kind, "{message}", {"message": message, "at": at})


def _number_as_constant(value: Any) -> Any:
    if isinstance(value, bool):
        raise _invalid("expected a number or a distribution")
    if isinstance(value, int | float):
        return {"constant": value}
    if isinstance(value, str):  # YAML 1.1 reads 12.5e6 (no sign in the exponent) as a string
        try:
            return {"constant": float(value)}
        except ValueError:
            raise _invalid("expected a number or a distribution") from None
    if isinstance(value, dict) and len(value) != 1:
        keys = ", ".join(map(str, value)) or "nothing"
        raise _invalid(f"a distribution is one of {', '.join(Distribution.model_fields)}, got {keys}")
    return value


class Distribution(_Strict):
    """A number, or one distribution: ``{exponential: {mean}}``, ``{lognormal: {mu | median, sigma}}``,
    ``{pareto: {alpha, scale}}``, ``{uniform: {low, high}}`` or ``{constant: x}``."""

    constant: float | None = Field(None, allow_inf_nan=False)
    exponential: Exponential | None = None
    lognormal: LogNormal | None = None
    pareto: Pareto | None = None
    uniform: Uniform | None = None

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> Any:
        data: dict[str, Any] = handler(self)
        return self.constant if self.constant is not None else {k: v for k, v in data.items() if v is not None}

    def draw(self, rng: Callable[[], np.random.Generator]) -> float:
        """One value; `rng` makes the generator, and is not called for a constant."""
        if self.constant is not None:
            return self.constant
        gen = rng()
        if self.exponential:
            return float(gen.exponential(self.exponential.mean))
        if self.lognormal:
            return float(gen.lognormal(self.lognormal.log_centre, self.lognormal.sigma))
        if self.pareto:
            return float((gen.pareto(self.pareto.alpha) + 1.0) * self.pareto.scale)
        assert self.uniform is not None  # one is set: Dist's validator
        return float(gen.uniform(self.uniform.low, self.uniform.high))

    def mean(self) -> float:
        if self.constant is not None:
            return self.constant
        if self.exponential:
            return self.exponential.mean
        if self.lognormal:
            return math.exp(self.lognormal.log_centre + self.lognormal.sigma**2 / 2)
        if self.pareto:
            a = self.pareto.alpha
            return a * self.pareto.scale / (a - 1) if a > 1 else math.inf
        assert self.uniform is not None
        return (self.uniform.low + self.uniform.high) / 2

    def bounds(self) -> tuple[float, float]:
        """The smallest and largest value it can draw (the support's ends)."""
        if self.constant is not None:
            return self.constant, self.constant
        if self.pareto:
            return self.pareto.scale, math.inf
        if self.uniform:
            return self.uniform.low, self.uniform.high
        return 0.0, math.inf  # exponential, lognormal: positive

    @model_validator(mode="after")
    def _exactly_one(self) -> Distribution:
        given = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give one distribution, got {' and '.join(given) or 'none'}")
        return self


def _positive(dist: Distribution) -> Distribution:
    low, high = dist.bounds()
    if low < 0 or high <= 0 or (low == 0 and not (dist.exponential or dist.lognormal)):
        raise _invalid(f"must be positive, but this can draw {low}", kind="support")
    return dist


def _non_negative(dist: Distribution) -> Distribution:
    if dist.bounds()[0] < 0:
        raise _invalid(f"must be non-negative, but this can draw {dist.bounds()[0]}", kind="support")
    return dist


Dist = Annotated[Distribution, BeforeValidator(_number_as_constant)]
Positive = Annotated[Distribution, BeforeValidator(_number_as_constant), AfterValidator(_positive)]
NonNegative = Annotated[Distribution, BeforeValidator(_number_as_constant), AfterValidator(_non_negative)]


# -- the scenario ----------------------------------------------------------------------------------


def _open_end(value: Any) -> Any:
    """``[t0, .inf]`` and ``[t0, null]`` both mean online from t0 on (stored as null: JSON has no inf)."""
    if isinstance(value, list | tuple) and len(value) == 2 and value[1] == math.inf:
        return [value[0], None]
    return value


Window = Annotated[
    tuple[
        Annotated[float, Field(ge=0, allow_inf_nan=False)], Annotated[float, Field(gt=0, allow_inf_nan=False)] | None
    ],
    BeforeValidator(_open_end),
]


class OnOff(_Strict):
    """Alternating online and offline periods, each drawn afresh, until the scenario's horizon."""

    on_s: Positive = Field(..., description="how long each online period lasts")
    off_s: Positive = Field(..., description="how long each offline period lasts")
    start: Literal["online", "offline", "random"] = Field(
        "online", description="random: online with probability E[on_s] / (E[on_s] + E[off_s])"
    )


class Availability(_Strict):
    """When the node is online: fixed `windows` (optionally repeated every `period_s`), or `onoff`."""

    windows: list[Window] | None = Field(None, description="[t0, t1] pairs, sorted; t1 null: online from t0 on")
    period_s: float | None = Field(None, gt=0, allow_inf_nan=False, description="repeat the windows with this period")
    offset_s: NonNegative | None = Field(None, description="shift the repeated windows per node (modulo the period)")
    onoff: OnOff | None = None

    @field_validator("windows")
    @classmethod
    def _sorted_apart(cls, windows: list[tuple[float, float | None]] | None) -> Any:
        for i, (t0, t1) in enumerate(windows or []):
            if t1 is not None and t1 <= t0:
                raise _invalid(f"window [{t0}, {t1}] ends before it starts", i)
            if t1 is None and i < len(windows or []) - 1:
                raise _invalid("only the last window may stay open (t1 null)", i)
            if i:
                prev_end = windows[i - 1][1]  # type: ignore[index]
                if prev_end is not None and t0 < prev_end:
                    raise _invalid(
                        f"window [{t0}, {t1}] starts before the previous one ends ({prev_end}): windows are sorted"
                        " and do not overlap",
                        i,
                    )
        return windows

    @model_validator(mode="after")
    def _one_kind(self) -> Availability:
        if (self.windows is None) == (self.onoff is None):
            raise ValueError("give windows or onoff (one of them)")
        if self.onoff is not None and (self.period_s is not None or self.offset_s is not None):
            raise ValueError("period_s and offset_s repeat windows; they do not apply to onoff")
        if self.offset_s is not None and self.period_s is None:
            raise ValueError("offset_s needs period_s")
        if self.period_s is not None:
            for i, (_, t1) in enumerate(self.windows or []):
                if t1 is None or t1 > self.period_s:
                    raise _invalid(f"repeated windows lie within [0, period_s = {self.period_s}]", "windows", i)
        return self


class Link(_Strict):
    latency_s: NonNegative | None = Field(None, description="one way, each message")
    bandwidth_bps: Positive | None = Field(None, description="bytes per second, each way; unset: unlimited")


class Crash(_Strict):
    at: NonNegative = Field(..., description="seconds from the start; a crash while offline changes nothing")
    reconnect_after: Positive | None = Field(None, description="back online this long after; unset: never")


class Compute(_Strict):
    """The modelled compute time of one task at speed factor 1: task_s + per_sample_s x the node's samples."""

    task_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    per_sample_s: float = Field(0.0, ge=0, allow_inf_nan=False)


def _node_selection(value: Any) -> Any:
    if value == "all" or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return value
    raise _invalid("expected all or a list of node ids")


class Group(_Strict):
    """Some nodes and what happens to them; a setting left out is left as earlier groups set it."""

    name: str | None = Field(None, min_length=1, description="a label; it also keys the group's random draws")
    nodes: Annotated[Literal["all"] | list[str], BeforeValidator(_node_selection)] = "all"
    fraction: float = Field(1.0, gt=0, le=1, description="a seeded share of `nodes` (rounded to the nearest count)")
    availability: Availability | None = None
    join_at: NonNegative | None = Field(None, description="offline before this")
    leave_at: Positive | None = Field(None, description="offline from this on")
    speed: Positive | None = Field(None, description="compute-time factor: 10 = ten times slower")
    link: Link | None = None
    drop_p: float | None = Field(None, ge=0, le=1, description="probability that the node drops a task it got")
    crashes: list[Crash] | None = None

    @field_validator("nodes")
    @classmethod
    def _distinct(cls, nodes: str | list[str]) -> str | list[str]:
        if isinstance(nodes, list):
            for i, node in enumerate(nodes):
                if node in nodes[:i]:
                    raise _invalid(f"{node!r} is listed twice", i)
        return nodes

    def settings(self) -> list[str]:
        """The per-node settings this group sets (what it overrides)."""
        names = [
            n
            for n in ("availability", "join_at", "leave_at", "speed", "drop_p", "crashes")
            if getattr(self, n) is not None
        ]
        if self.link is not None:
            names += [n for n in ("latency_s", "bandwidth_bps") if getattr(self.link, n) is not None]
        return names


class TraceRow(_Strict):
    """One event of a measured trace: `node` goes online, offline or crashes at `time`, or its `speed`
    (a compute-time factor), `bandwidth` (bytes/s) or `latency` (s) is `value` (time 0: for the run)."""

    node: str = Field(..., min_length=1)
    event: Literal["online", "offline", "crash", "speed", "bandwidth", "latency"]
    time: float = Field(..., ge=0, allow_inf_nan=False)
    value: float | None = Field(None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _value_fits(self) -> TraceRow:
        if self.event in ("online", "offline", "crash"):
            if self.value is not None:
                raise ValueError(f"a {self.event} event takes no value")
            return self
        if self.value is None:
            raise ValueError(f"a {self.event} event needs a value")
        if self.time != 0:
            raise ValueError(
                f"{self.event} is set for the whole run: its time must be 0 (a change later is not modelled)"
            )
        if self.value < 0 or (self.value == 0 and self.event != "latency"):
            raise ValueError(f"{self.event} must be {'non-negative' if self.event == 'latency' else 'positive'}")
        return self


def _trace_problems(rows: Sequence[TraceRow]) -> list[tuple[int, str]]:
    """Rows that contradict earlier ones: a node's speed, bandwidth or latency given twice."""
    seen: dict[tuple[str, str], int] = {}
    problems = []
    for i, row in enumerate(rows):
        if row.event in ("speed", "bandwidth", "latency"):
            first = seen.setdefault((row.node, row.event), i)
            if first != i:
                problems.append((i, f"{row.node}'s {row.event} is given twice (first in row {first + 1})"))
    return problems


class ScenarioConfig(_Strict):
    """A scenario: later groups override earlier ones, per setting, for the nodes they select; the
    trace overrides the groups for the nodes and settings it names."""

    horizon_s: float = Field(86_400.0, gt=0, allow_inf_nan=False, description="on/off and repeated windows end here")
    seed: int = Field(0, description="added to the experiment's seed")
    compute: Compute = Field(default_factory=Compute)
    groups: list[Group] = Field(default_factory=list)
    trace: list[TraceRow] = Field(default_factory=list, description="measured events (a trace file, read inline)")
    _origin: SourceMap | None = PrivateAttr(None)
    """Where the scenario was read from, for the file and line in `check`'s errors."""

    @model_validator(mode="before")
    @classmethod
    def _not_a_path(cls, data: Any) -> Any:
        if isinstance(data, str):
            raise _invalid(
                "a scenario file is read only where an experiment file names it (relative to that file);"
                " here give the scenario's mapping"
            )
        return data

    def __eq__(self, other: object) -> bool:
        """Equal when the settings are; which file they were read from does not count."""
        if not isinstance(other, ScenarioConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]

    @field_validator("trace")
    @classmethod
    def _consistent_trace(cls, rows: list[TraceRow]) -> list[TraceRow]:
        for i, message in _trace_problems(rows)[:1]:
            raise _invalid(message, i)
        return rows

    @model_validator(mode="after")
    def _bounded(self) -> ScenarioConfig:
        for i, group in enumerate(self.groups):
            if group.name is not None and group.name in [g.name for g in self.groups[:i]]:
                raise _invalid(f"group name {group.name!r} is used twice", "groups", i, "name")
            a = group.availability
            if a is None:
                continue
            if a.onoff is not None:
                cycle = a.onoff.on_s.mean() + a.onoff.off_s.mean()
                count = 2 * self.horizon_s / cycle
            else:
                count = 2 * len(a.windows or []) * (self.horizon_s / a.period_s + 2) if a.period_s else 0
            if count > MAX_TRANSITIONS:
                raise _invalid(
                    f"about {count:.0f} transitions per node over horizon_s: more than {MAX_TRANSITIONS};"
                    " lengthen the periods or shorten horizon_s",
                    *("groups", i, "availability"),
                )
        return self

    def check(self, node_ids: Collection[str], sources: SourceMap | None = None, at: Loc = ()) -> None:
        """Refuse node ids that are not the experiment's (ConfigError naming the file and line: from
        `sources`, where the scenario sits at `at`, when it was read as part of an experiment file)."""
        known = node_ids if isinstance(node_ids, set | frozenset) else set(node_ids)
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for g, group in enumerate(self.groups):
            if isinstance(group.nodes, list):
                problems += [(("groups", g, "nodes", i), f"{n!r}") for i, n in enumerate(group.nodes) if n not in known]
        problems += [(("trace", i), f"node {r.node!r}") for i, r in enumerate(self.trace) if r.node not in known]
        if not problems:
            return
        span = f"{min(known)} .. {max(known)}" if known else "none"

        def where(loc: Loc) -> str:
            found = sources.where((*at, *loc)) if sources is not None else None
            return found or (self._origin.where(loc) if self._origin is not None else None) or "scenario"

        lines = [f"{where(loc)}: {dotted(loc)}: {what} is not a node of the experiment" for loc, what in problems]
        more = f"\n    ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        raise ConfigError(
            f"scenario names unknown nodes (the experiment's are {span}):\n    " + "\n    ".join(lines[:10]) + more
        )


# -- reading files ---------------------------------------------------------------------------------


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation) if get_origin(annotation) is not None else ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _fields_at(loc: Sequence[str | int]) -> list[str]:
    """The fields allowed where an unknown one was found."""
    model: type[BaseModel] | None = ScenarioConfig
    for part in loc[:-1]:
        if isinstance(part, str):
            field = model.model_fields.get(part) if model is not None else None
            model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _problem(error: Any) -> tuple[tuple[str | int, ...], str]:
    """A pydantic error as (location, message); a validator may point deeper with ctx ``at``."""
    loc = (*error["loc"], *(error.get("ctx") or {}).get("at", ()))
    if error["type"] == "extra_forbidden":
        return loc, f"unknown field; allowed here: {', '.join(_fields_at(error['loc']))}"
    message = str(error["msg"]).removeprefix("Value error, ")
    value = error.get("input")
    if not isinstance(value, dict | list) and value is not None and error["type"] not in ("missing", "support"):
        message += f" (got {value!r})"
    return loc, message


def _validate(data: Any, source: str, sources: SourceMap) -> ScenarioConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a scenario is a YAML mapping, got {type(data).__name__}")
    try:
        scenario = ScenarioConfig.model_validate(data)
    except ValidationError as exc:
        lines = [sources.render(*_problem(e), data, default=source) for e in exc.errors()]
        raise ConfigError(f"{source}: the scenario is invalid:\n  " + "\n  ".join(lines)) from None
    scenario._origin = sources
    return scenario


def parse_scenario(data: Any, *, source: str = "scenario", base: str | Path | None = None) -> ScenarioConfig:
    """A scenario from a mapping; ``trace: FILE`` is read relative to `base` (a folder)."""
    data, sources = _inline_trace(data, base, source)
    return _validate(data, source, sources)


def load_scenario(path: str | Path) -> ScenarioConfig:
    """A scenario file, validated; its trace file (relative to it) is read into the scenario."""
    path = Path(path)
    document = read_yaml_file(path, "scenario file")
    data, sources = _inline_trace(document.data, path.parent, str(path))
    return _validate(data, str(path), sources.over(SourceMap.of(document)))


def resolve_scenario(value: Any, base: str | Path) -> Any:
    """What an experiment file's ``scenario:`` holds, made self-contained: a file name (relative to
    `base`, the experiment's folder) becomes the scenario's mapping, and a trace file its rows."""
    return resolve_scenario_sourced(value, base)[0]


def resolve_scenario_sourced(value: Any, base: str | Path) -> tuple[Any, SourceMap]:
    """`resolve_scenario`, and where the scenario's values were written (the scenario file's lines,
    the trace file's rows), as seen from the scenario: mount it where the scenario sits."""
    if isinstance(value, str):
        scenario = load_scenario(Path(base) / value)
        return scenario.model_dump(mode="json"), scenario._origin or SourceMap()
    return _inline_trace(value, base, "scenario")


def _inline_trace(data: Any, base: str | Path | None, source: str) -> tuple[Any, SourceMap]:
    """`data` with its trace file's rows in place of its name, and the rows' lines."""
    if not isinstance(data, dict) or not isinstance(data.get("trace"), str):
        return data, SourceMap()
    if base is None:
        raise ConfigError(f"{source}: trace: {data['trace']!r} names a file, but there is no folder to read it from")
    path = Path(base) / data["trace"]
    rows, lines = _load_trace(path)
    trace = [row.model_dump(mode="json") for row in rows]
    return data | {"trace": trace}, SourceMap().rows(("trace",), str(path), lines)


def load_trace(path: str | Path) -> list[TraceRow]:
    """A trace file: CSV (header ``node,event,time`` and optionally ``value``), a JSON list of objects
    with those keys, or JSON lines. Errors name the file and the row's line."""
    return _load_trace(Path(path))[0]


def _load_trace(path: Path) -> tuple[list[TraceRow], tuple[int, ...]]:
    text = _read(path, "trace file")
    if path.suffix == ".csv":
        raw = _csv_rows(text, path)
    elif path.suffix in (".json", ".jsonl", ".ndjson"):
        raw = _json_rows(text, path)
    else:
        raise ConfigError(f"trace file {path}: expected a .csv, .json or .jsonl file")
    rows, lines, problems = [], [], []
    for line, item in raw:
        try:
            rows.append(TraceRow.model_validate(item))
            lines.append(line)
        except ValidationError as exc:
            problems += [f"{path}:{line}: {dotted(loc)}: {msg}" for loc, msg in map(_problem, exc.errors())]
    problems += [f"{path}:{lines[i]}: {message}" for i, message in _trace_problems(rows)]
    if problems:
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ConfigError(f"trace file {path} is invalid:\n  " + "\n  ".join(problems[:10]) + more)
    return rows, tuple(lines)


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _csv_rows(text: str, path: Path) -> list[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(text.splitlines(), skipinitialspace=True)
    header = [name.strip() for name in reader.fieldnames or []]
    if not {"node", "event", "time"} <= set(header) or not set(header) <= {"node", "event", "time", "value"}:
        raise ConfigError(f"{path}:1: the header is {','.join(header) or 'empty'}; expected node,event,time[,value]")
    reader.fieldnames = header
    rows = []
    for row in reader:
        if None in row:
            raise ConfigError(f"{path}:{reader.line_num}: more fields than the header's {len(header)}")
        rows.append((reader.line_num, {k: v.strip() for k, v in row.items() if v is not None and v.strip() != ""}))
    return rows


def _json_rows(text: str, path: Path) -> list[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    items: list[tuple[int, Any]] = []
    try:
        i = len(text) - len(text.lstrip())
        if text[i : i + 1] != "[":  # JSON lines
            return [(n, _json_line(line, n, path)) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        i, line, counted = i + 1, 1, 0
        while True:
            i += len(text[i:]) - len(text[i:].lstrip())
            if text[i : i + 1] == "]":
                return items
            line += text.count("\n", counted, i)
            counted = i
            item, i = decoder.raw_decode(text, i)
            items.append((line, item))
            i += len(text[i:]) - len(text[i:].lstrip())
            if text[i : i + 1] == ",":
                i += 1
            elif text[i : i + 1] != "]":
                raise json.JSONDecodeError("expected , or ]", text, i)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None


def _json_line(line: str, number: int, path: Path) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{number}: not valid JSON: {exc.msg}") from None


# -- expansion -------------------------------------------------------------------------------------

_Intervals = list[tuple[float, float]]
"""Online periods [start, end), sorted and apart; end may be inf."""


def expand(scenario: ScenarioConfig, node_ids: list[str], seed: int) -> dict[str, NodeScript]:
    """One NodeScript per node of `node_ids`. Every draw comes from a stream keyed by the seed, the
    group (its name, else its position), the setting and the node, so adding a node shifts no other's."""
    scenario.check(node_ids)
    seed += scenario.seed
    default = NodeScript(task_s=scenario.compute.task_s, per_sample_s=scenario.compute.per_sample_s, seed=seed)
    chosen: dict[str, dict[str, int]] = {}  # node -> setting -> the last group that sets it
    for g, group in enumerate(scenario.groups):
        names = group.settings()
        for node in _select(group, _group_key(group, g), node_ids, seed):
            chosen.setdefault(node, {}).update(dict.fromkeys(names, g))
    traced: dict[str, list[TraceRow]] = {}
    for row in scenario.trace:
        traced.setdefault(row.node, []).append(row)
    return {
        node: _script(scenario, node, chosen.get(node, {}), traced.get(node, []), seed, default)
        if node in chosen or node in traced
        else default
        for node in node_ids
    }


def _group_key(group: Group, g: int) -> str | int:
    return group.name if group.name is not None else g


def _select(group: Group, key: str | int, node_ids: list[str], seed: int) -> list[str]:
    """The group's nodes; a fraction keeps the nodes with the smallest seeded per-node keys, so a
    node's membership changes only when the rounded count does."""
    pool = node_ids if group.nodes == "all" else group.nodes
    if group.fraction >= 1:
        return list(pool)
    count = math.floor(group.fraction * len(pool) + 0.5)
    ranked = sorted(
        pool, key=lambda n: (int(seed_sequence(seed, "scenario", key, "select", n).generate_state(1)[0]), n)
    )
    return ranked[:count]


def _script(
    scenario: ScenarioConfig, node: str, picks: dict[str, int], rows: list[TraceRow], seed: int, default: NodeScript
) -> NodeScript:
    groups = scenario.groups

    def value(setting: str, dist: Distribution) -> float:
        key = _group_key(groups[picks[setting]], picks[setting])
        return dist.draw(lambda: stream(seed, "scenario", key, setting, node))

    def setting(name: str) -> Any:
        group = groups[picks[name]]
        return (
            group.link and getattr(group.link, name) if name in ("latency_s", "bandwidth_bps") else getattr(group, name)
        )

    fields: dict[str, Any] = {}
    for name, attr in (("speed", "compute_factor"), ("latency_s", "latency_s"), ("bandwidth_bps", "bandwidth_bps")):
        if name in picks:
            fields[attr] = value(name, setting(name))
    if "drop_p" in picks:
        fields["drop_p"] = setting("drop_p")
    for row in rows:
        if row.event in ("speed", "bandwidth", "latency"):
            fields[{"speed": "compute_factor", "bandwidth": "bandwidth_bps", "latency": "latency_s"}[row.event]] = (
                row.value
            )

    crashed: set[float] = set()
    moves = [r for r in rows if r.event in ("online", "offline", "crash")]
    if moves:
        online = _trace_timeline(moves, crashed)
    elif "availability" in picks:
        key = _group_key(groups[picks["availability"]], picks["availability"])
        online = _availability(
            setting("availability"), scenario.horizon_s, lambda what: stream(seed, "scenario", key, what, node)
        )
    else:
        online = [(0.0, math.inf)]
    join = value("join_at", setting("join_at")) if "join_at" in picks else 0.0
    leave = value("leave_at", setting("leave_at")) if "leave_at" in picks else math.inf
    online = [(max(a, join), min(b, leave)) for a, b in online if min(b, leave) > max(a, join)]
    if "crashes" in picks:
        key = _group_key(groups[picks["crashes"]], picks["crashes"])
        rng = stream(seed, "scenario", key, "crashes", node)
        draws = [
            (c.at.draw(lambda: rng), c.reconnect_after.draw(lambda: rng) if c.reconnect_after else math.inf)
            for c in setting("crashes")
        ]
        for at, after in sorted(draws):
            if any(a < at < b for a, b in online):
                crashed.add(at)
            online = _cut(online, at, at + after)

    transitions = []
    for a, b in online:
        if a > 0:
            transitions.append(Transition(a, True))
        if b < math.inf:
            transitions.append(Transition(b, False, crash=b in crashed))
    starts_online = bool(online) and online[0][0] <= 0
    return NodeScript(
        transitions=tuple(transitions),
        starts_online=starts_online,
        task_s=default.task_s,
        per_sample_s=default.per_sample_s,
        seed=seed,
        **fields,
    )


def _availability(a: Availability, horizon: float, rng: Callable[[str], np.random.Generator]) -> _Intervals:
    if a.onoff is not None:
        return _onoff(a.onoff, horizon, rng("onoff"))
    windows = [(t0, math.inf if t1 is None else t1) for t0, t1 in a.windows or []]
    if a.period_s is None:
        return windows
    period = a.period_s
    offset = a.offset_s.draw(lambda: rng("offset")) % period if a.offset_s is not None else 0.0
    repeats = [
        (t0 + k * period + offset, t1 + k * period + offset)
        for k in range(-1, math.ceil(horizon / period) + 1)
        for t0, t1 in windows
    ]
    return _until(_merge(repeats), horizon)


def _onoff(spec: OnOff, horizon: float, rng: np.random.Generator) -> _Intervals:
    if spec.start == "random":
        on, off = spec.on_s.mean(), spec.off_s.mean()
        p = 0.5 if math.isinf(on) and math.isinf(off) else 1.0 if math.isinf(on) else on / (on + off)
        online = bool(rng.random() < p)
    else:
        online = spec.start == "online"
    t, periods = 0.0, []
    while t < horizon:
        d = (spec.on_s if online else spec.off_s).draw(lambda: rng)
        if online:
            periods.append((t, t + d))
        t, online = t + d, not online
    return _until(periods, horizon)


def _until(online: _Intervals, horizon: float) -> _Intervals:
    """Generated periods up to the horizon; the state at the horizon stays."""
    out = [(max(a, 0.0), b) for a, b in online if b > 0 and a < horizon]
    if out and out[-1][1] > horizon:
        out[-1] = (out[-1][0], math.inf)
    return out


def _merge(periods: _Intervals) -> _Intervals:
    out: _Intervals = []
    for a, b in sorted(periods):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _cut(online: _Intervals, lo: float, hi: float) -> _Intervals:
    """`online` less [lo, hi)."""
    out: _Intervals = []
    for a, b in online:
        out += [(a, min(b, lo))] if a < min(b, lo) else []
        out += [(max(a, hi), b)] if max(a, hi) < b else []
    return out


def _trace_timeline(moves: list[TraceRow], crashed: set[float]) -> _Intervals:
    """A node's online periods from its trace events (sorted by time, file order within a time). Before
    its first event the node is in the opposite state; an event that changes nothing (offline twice,
    a crash while offline) is tolerated and ignored."""
    moves = sorted(moves, key=lambda r: r.time)
    online = moves[0].event != "online"
    start = 0.0
    periods: _Intervals = []
    for row in moves:
        if row.event == "online" and not online:
            online, start = True, row.time
        elif row.event != "online" and online:
            online = False
            if row.time > start:
                periods.append((start, row.time))
            if row.event == "crash":
                crashed.add(row.time)
    if online:
        periods.append((start, math.inf))
    return _merge(periods)
