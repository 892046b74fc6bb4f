"""The site's generated reference pages: the experiment file's schema and the command line.

A mkdocs hook (mkdocs.yml, `hooks:`): a page holding a marker line gets the marker replaced at build
time by what it names, read from the code itself, so the reference cannot drift from it:
- ``<!-- fedmq:config-schema -->``: every field of `fedmq.experiments.config.ExperimentConfig` and of
  each section it holds (pydantic models, walked recursively), with type, default, bounds and
  description;
- ``<!-- fedmq:cli -->``: `fedmq --help` and every subcommand's help, from
  `fedmq.experiments.cli.build_parser()`.

`python docs/hooks/reference.py config|cli` prints either, to read it without building the site.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKERS = {"<!-- fedmq:config-schema -->": "config", "<!-- fedmq:cli -->": "cli"}


# -- the experiment file ---------------------------------------------------------------------------


def _anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def _type(annotation: Any, found: list[type[BaseModel]]) -> str:
    """`annotation` as a reader writes it in YAML terms; models met are appended to `found`."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _type(get_args(annotation)[0], found)
    if origin in (Union, types.UnionType):
        return " or ".join(_type(arg, found) for arg in get_args(annotation))
    if origin is Literal:
        return " or ".join(f"`{arg}`" if isinstance(arg, str) else f"`{arg!r}`" for arg in get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return f"list of {_type(args[0], found)}" if args else "list"
    if origin is dict:
        key, value = get_args(annotation) or (Any, Any)
        return f"map of {_type(key, found)} to {_type(value, found)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if annotation not in found:
            found.append(annotation)
        return f"[{_title(annotation)}](#{_anchor(annotation)})"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(f"`{member.value}`" for member in annotation)
    if annotation is type(None):
        return "`null`"
    if annotation is Any:
        return "any"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if annotation in names:
        return names[annotation]
    return f"`{getattr(annotation, '__name__', annotation)}`"


def _title(model: type[BaseModel]) -> str:
    return model.__name__.removesuffix("Fields")


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        factory: Any = info.default_factory
        if isinstance(factory, type) and issubclass(factory, BaseModel):
            return "its section's defaults"
        try:
            value = factory()
        except TypeError:
            return "computed"
        return f"`{value!r}`" if value not in ({}, []) else ("`{}`" if value == {} else "`[]`")
    if info.default is PydanticUndefined:
        return "**required**"
    value = info.default
    if isinstance(value, BaseModel):
        return "its section's defaults"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`" if not isinstance(value, str) else f"`{value}`"


def _bounds(info: FieldInfo) -> str:
    parts = []
    for item in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(item, attr, None)
            if value is not None and type(item).__name__.lower() == attr:
                parts.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
        if type(item).__name__ == "MinLen":
            parts.append(f"length >= {item.min_length}")
        if type(item).__name__ == "MaxLen":
            parts.append(f"length <= {item.max_length}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _model_doc(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if not doc or doc.startswith(f"{model.__name__}(") or ("pydantic" in doc.lower() and "usage docs" in doc.lower()):
        return ""
    return " ".join(doc.split())


def _implied(name: str, annotation: Any, kind: str) -> str:
    """What a field without a description of its own is, where its type says it: a section, or the
    `kind` that selects one of several sections."""
    args = get_args(annotation)
    if name == "kind" and get_origin(annotation) is Literal and len(args) == 1:
        return f"`{name}: {args[0]}` selects this section"
    if "](#" in kind:
        return "see the table its type links to"
    return ""


def config_schema() -> str:
    """Markdown: one table of fields per section of the experiment file, starting at the file's top."""
    from fedmq.experiments.config import ExperimentConfig

    found: list[type[BaseModel]] = [ExperimentConfig]
    out: list[str] = []
    index = 0
    while index < len(found):
        model = found[index]
        index += 1
        title = "The experiment file" if model is ExperimentConfig else _title(model)
        out.append(f"## {title} {{#{_anchor(model)}}}\n")
        doc = _model_doc(model)
        if doc:
            out.append(doc + "\n")
        out.append("| field | type | default | bounds | description |")
        out.append("|---|---|---|---|---|")
        for name, info in model.model_fields.items():
            kind = _type(info.annotation, found)
            description = info.description or _implied(name, info.annotation, kind)
            cells = (f"`{name}`", kind, _default(info), _bounds(info), description)
            out.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        out.append("")
    return "\n".join(out)


# -- the command line ------------------------------------------------------------------------------


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def cli_reference() -> str:
    """Markdown: `fedmq --help`, then a section per subcommand (and theirs) with its full help."""
    from fedmq.experiments.cli import build_parser

    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same width on every machine
    parser = build_parser()
    out = ["## fedmq\n", "```text", parser.format_help().rstrip(), "```", ""]

    def walk(prefix: str, parent: argparse.ArgumentParser) -> None:
        for name, summary, sub in _subcommands(parent):
            out.extend([f"## {prefix} {name}\n", f"{summary}\n" if summary else ""])
            out.extend(["```text", sub.format_help().rstrip(), "```", ""])
            walk(f"{prefix} {name}", sub)

    walk("fedmq", parser)
    return "\n".join(out)


# -- the mkdocs hook -------------------------------------------------------------------------------

GENERATORS = {"config": config_schema, "cli": cli_reference}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for marker, kind in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, GENERATORS[kind]())
    return markdown


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1] if len(sys.argv) > 1 else "config"]())
