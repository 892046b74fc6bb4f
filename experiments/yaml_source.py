"""YAML files read with the line of every key, and one way to say where a bad value was written.

Experiment files, grid files and scenario files are all validated after they are read (and merged,
overridden, expanded), when the text is long gone. So that an error still names the file and line of
the offending key, a file is read into its data *and* PyYAML's composed node tree, whose nodes carry
their marks; a `SourceMap` keeps those trees (and the places values came from that are no file: a
``--set``, a Python override, a grid axis, a trace file's rows) and answers, for a dotted path, where
it was written. Every loader renders its errors the same way with it::

    experiments/mnist.yaml:12: policy.fraction: Input should be less than or equal to 1 (got 1.5)
    --set 'policy.fraction=1.5': policy.fraction: Input should be less than or equal to 1 (got 1.5)
    experiments/bad.yaml:3:9: not valid YAML: expected ',' or ']', but got '<stream end>' (...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from fedmq.fedcore.errors import ConfigError

Loc = tuple[str | int, ...]
"""A path into the data: map keys and list indices, as pydantic's error locations are."""


def dotted(loc: Sequence[str | int]) -> str:
    """``groups[0].availability.windows[1]``: keys joined by dots, list indices in brackets."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


# -- reading -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    """A YAML file's data and its composed root node (None for an empty file), whose marks give lines."""

    source: str
    data: Any
    root: yaml.Node | None


def parse_yaml(text: str, source: str) -> Document:
    """`text` parsed once, keeping the node tree; a syntax error is a ConfigError at its file:line:column.

    The safe loader composes the node tree and builds the data from it (no arbitrary objects); the
    tree is kept rather than parsing the text a second time for the lines."""
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        raise syntax_error(source, exc) from None
    finally:
        loader.dispose()
    return Document(source, data, root)


def read_yaml_file(path: str | Path, what: str) -> Document:
    """A YAML file (`what` names it in the error when it cannot be read: "experiment file")."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
    return parse_yaml(text, str(path))


def syntax_error(source: str, exc: yaml.YAMLError) -> ConfigError:
    """PyYAML's error as ``FILE:LINE:COLUMN: not valid YAML: problem (context at line L, column C)``.

    PyYAML's own text names the stream (``"<unicode string>"``) rather than the file, and puts the
    marks on lines of their own; here the file and the problem's position come first, as compilers
    write them, so that editors and terminals can jump to it."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return ConfigError(f"{source}: not valid YAML: {exc}")
    mark = exc.problem_mark
    problem = exc.problem or "a syntax error"
    context = ""
    if exc.context:
        cmark = exc.context_mark
        at = f" at line {cmark.line + 1}, column {cmark.column + 1}" if cmark is not None else ""
        context = f" ({exc.context}{at})"
    note = f"; {exc.note}" if exc.note else ""
    return ConfigError(f"{source}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}{context}{note}")


# -- where a value came from -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Tree:
    """A YAML document whose data sits at `at` in the whole (a scenario file read into an experiment)."""

    source: str
    root: yaml.Node
    at: Loc = ()

    def locate(self, loc: Loc) -> tuple[int, str] | None:
        """How deep into `loc` the document reaches, and the file:line of the deepest key found."""
        if loc[: len(self.at)] != self.at:
            return None
        node, line, depth = self.root, self.root.start_mark.line + 1, len(self.at)
        for part in loc[len(self.at) :]:
            if isinstance(node, yaml.MappingNode):
                match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
                if match is None:
                    break
                line, node = match[0].start_mark.line + 1, match[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                break
            depth += 1
        return depth, f"{self.source}:{line}"


@dataclass(frozen=True)
class _Rows:
    """Rows read from a table (a scenario's trace file): row i at `at`[i] was written on `lines[i]`."""

    source: str
    lines: tuple[int, ...]
    at: Loc

    def locate(self, loc: Loc) -> tuple[int, str] | None:
        n = len(self.at)
        row = loc[n] if len(loc) > n and loc[:n] == self.at else None
        if not isinstance(row, int) or not 0 <= row < len(self.lines):
            return None
        return n + 1, f"{self.source}:{self.lines[row]}"


@dataclass(frozen=True)
class _Set:
    """A value set at `at` from outside the files: it and everything under it came from `where`."""

    where: str
    at: Loc

    def locate(self, loc: Loc) -> tuple[int, str] | None:
        return (len(self.at), self.where) if loc[: len(self.at)] == self.at else None


_Layer = _Tree | _Rows | _Set
_MISSING: Any = object()


@dataclass(frozen=True)
class SourceMap:
    """Where the values of one config were written, layer over layer (the first wins, as it was applied
    last: a ``--set`` over the file, a file over the file it extends). Immutable: each grid cell adds its
    own layers to the file's map."""

    layers: tuple[_Layer, ...] = ()

    @classmethod
    def of(cls, document: Document) -> SourceMap:
        return cls((_Tree(document.source, document.root),) if document.root is not None else ())

    def over(self, below: SourceMap) -> SourceMap:
        """This map's layers above those of `below` (a file over the file it extends)."""
        return SourceMap(self.layers + below.layers)

    def set(self, at: Sequence[str | int], where: str) -> SourceMap:
        """The value at `at` now comes from `where` (``--set 'rounds=5'``, a grid axis' file:line)."""
        return SourceMap((_Set(where, tuple(at)), *self.layers))

    def rows(self, at: Sequence[str | int], source: str, lines: Sequence[int]) -> SourceMap:
        """The list at `at` was read from the table `source`, row i on `lines[i]`."""
        return SourceMap((_Rows(source, tuple(lines), tuple(at)), *self.layers))

    def mounted(self, at: Sequence[str | int]) -> SourceMap:
        """This map with its data placed at `at` of a larger whole (a scenario inside an experiment)."""
        return SourceMap(tuple(replace(layer, at=(*at, *layer.at)) for layer in self.layers))

    def where(self, loc: Sequence[str | int], data: Any = _MISSING) -> str | None:
        """``FILE:LINE`` (or ``--set ...``) for the value at `loc`; None when no layer knows it.

        With the `data` that was validated, the path is first cut to its longest part present there:
        that value came from the first layer that holds the whole of it (a layer above replaced or
        merged the ones below), which keeps a file that an ``extends`` overrode from being named. A
        missing key is named at its section."""
        loc = tuple(loc)
        target = loc if data is _MISSING else loc[: _present(loc, data)]
        best: tuple[int, str] | None = None
        for layer in self.layers:
            found = layer.locate(target)
            if found is None:
                continue
            if found[0] == len(target):
                return found[1]
            if best is None or found[0] > best[0]:
                best = found
        return best[1] if best is not None else None

    def render(
        self, loc: Sequence[str | int], message: str, data: Any = _MISSING, *, default: str | None = None
    ) -> str:
        """``FILE:LINE: a.b[2]: message``; where no layer knows the path, `default` (the config's name)
        or nothing stands for the place."""
        where = self.where(loc, data) or default
        return f"{where + ': ' if where else ''}{dotted(loc)}: {message}"


def _present(loc: Loc, data: Any) -> int:
    """How many parts of `loc` exist in `data`, from its top."""
    for depth, part in enumerate(loc):
        in_map = isinstance(data, dict) and part in data
        in_list = isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data)
        if not (in_map or in_list):
            return depth
        data = data[part]
    return len(loc)
