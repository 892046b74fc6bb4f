"""The site's generated reference (docs/hooks/reference.py) holds every field of the experiment file and
every command, and the pages that hold its markers exist (`mkdocs build --strict` in scripts/test
checks the links)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from pydantic import BaseModel

from fedmq.experiments.cli import build_parser
from fedmq.experiments.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[2]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedmq_docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> None:
    """Every section reachable from `model` (through unions, lists and maps)."""
    if model in seen:
        return
    seen.add(model)

    def walk(annotation: object) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _models(annotation, seen)
        for arg in getattr(annotation, "__args__", ()):
            walk(arg)
        for arg in getattr(annotation, "__metadata__", ()):
            walk(arg)
        origin = getattr(annotation, "__origin__", None)
        if origin is not None and origin is not annotation:
            walk(origin)

    for info in model.model_fields.values():
        walk(info.annotation)


def test_the_schema_holds_every_field_of_every_section() -> None:
    text = _hook().config_schema()
    models: set[type[BaseModel]] = set()
    _models(ExperimentConfig, models)
    assert len(models) > 10
    for model in models:
        anchor = "{#" + model.__name__.lower() + "}"
        assert anchor in text, f"no section for {model.__name__}"
        section = text.split(anchor, 1)[1].split("\n## ", 1)[0]
        for name in model.model_fields:
            assert f"| `{name}` |" in section, f"{model.__name__}.{name} is missing"
    assert "| `nodes` | integer | **required** | >= 1, <= 100,000 |" in text


def test_the_command_line_holds_every_command() -> None:
    text = _hook().cli_reference()
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert commands
    for name in commands:
        assert f"## fedmq {name}\n" in text
    assert "usage: fedmq run" in text


def test_the_reference_pages_hold_the_markers() -> None:
    hook = _hook()
    pages = {path.name: path.read_text() for path in (ROOT / "docs" / "reference").glob("*.md")}
    assert set(hook.MARKERS) <= {marker for text in pages.values() for marker in hook.MARKERS if marker in text}
    assert "::: fedmq.api" in pages["api.md"]
