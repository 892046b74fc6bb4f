"""Finding a user's own method, model or dataset from the name an experiment file gives it.

A name that is not built in is looked up, in this order, as
1. an entry point in the group for its kind (``fedmq.methods``, ``fedmq.models``, ``fedmq.datasets``),
   which an installed distribution declares in its metadata;
2. a reference ``package.module:attribute`` (or ``package.module`` for a method, whose module holds
   ``SPEC``), imported from the folder fedmq runs in, PYTHONPATH or site-packages.

Why the current folder: ``python -m fedmq`` and the daemons ``fedmq run`` starts (``python -m fedmq``,
in the same folder) have it on ``sys.path``, the ``fedmq`` script does not; adding it, last, gives
every process of a federation started in the user's folder the same modules, and never lets that
folder shadow an installed package. Failures are `ConfigError` naming the option and what was tried,
never a traceback: a plug-in is the user's code, and its mistakes are settings to fix.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from fedmq.fedcore.errors import ConfigError

GROUPS = {"method": "fedmq.methods", "model": "fedmq.models", "dataset": "fedmq.datasets"}
"""The entry-point group of each kind of plug-in."""


_CACHES: list[dict[str, Any]] = []


def cache() -> dict[str, Any]:
    """A dict of resolved plug-ins by name, emptied by `forget`."""
    made: dict[str, Any] = {}
    _CACHES.append(made)
    return made


def forget() -> None:
    """Forget every plug-in this process resolved, so that the next use imports it again: for a notebook
    whose user edited their module (drop it from ``sys.modules`` too), and for tests."""
    for made in _CACHES:
        made.clear()


@dataclass(frozen=True, slots=True)
class Found:
    """What a plug-in name resolved to, and how (for messages and `fedmq methods`)."""

    value: Any
    module: str
    """The module that holds it: its source enters the method fingerprint."""
    origin: str
    """'entry point NAME -> TARGET' or 'module REFERENCE'."""


def entry_points(kind: str) -> dict[str, metadata.EntryPoint]:
    """The installed entry points of `kind`'s group, by name (the first of a duplicated name wins)."""
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUPS[kind]):
        found.setdefault(ep.name, ep)
    return found


def looks_like_reference(name: str) -> bool:
    """A dotted module path, with or without ``:attribute``: what only a plug-in name can be."""
    module = name.partition(":")[0]
    return bool(module) and all(part.isidentifier() for part in module.split("."))


def resolve(name: str, kind: str, *, field: str, default_attr: str | None, builtins: list[str]) -> Found:
    """The object `name` names: an entry point of `kind`, else ``module:attr`` (``module`` alone takes
    `default_attr`). ConfigError at `field` says what was tried and what to write instead."""
    eps = entry_points(kind)
    if name in eps:
        ep = eps[name]
        origin = f"{kind} {name!r} (entry point {ep.value} in {GROUPS[kind]})"
        module, _, attr = (part.strip() for part in ep.value.partition(":"))
        return Found(_load(module, attr or default_attr, kind, field, origin, None), module, origin)
    module, sep, attr = name.partition(":")
    tried = _unknown(name, kind, builtins, eps)
    if not looks_like_reference(name) or (sep and not all(p.isidentifier() for p in attr.split("."))):
        raise ConfigError(f"{tried}, and {name!r} is no module reference; {_example(kind)}", field=field)
    if not attr and default_attr is None:
        raise ConfigError(
            f"{tried}, and {name!r} names no {kind} in a module (module:NAME); {_example(kind)}", field=field
        )
    origin = f"{kind} {name!r}"
    return Found(_load(module, attr or default_attr, kind, field, origin, tried), module, origin)


def _load(module: str, attr: str | None, kind: str, field: str, origin: str, tried: str | None) -> Any:
    """`attr` of `module`, imported; `tried` (what else the name was looked up as) prefixes a missing module."""
    try:
        loaded = import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            where = f"the current folder {os.getcwd()}, PYTHONPATH and site-packages"
            lead = f"{tried}, and" if tried else f"{origin}:"
            raise ConfigError(
                f"{lead} no module {exc.name!r} is on the path ({where}); run fedmq in the folder that holds"
                f" it, add that folder to PYTHONPATH or pip install it; {_example(kind)}",
                field=field,
            ) from None
        raise ConfigError(f"{origin}: importing {module} failed: {exc}", field=field) from None
    except Exception as exc:  # the user's module failed to import: say where, without a traceback
        message = f"{origin}: importing {module} raised {type(exc).__name__}: {exc}"
        raise ConfigError(message[:800], field=field) from None
    value: Any = loaded
    for part in (attr or "").split("."):
        if part and not hasattr(value, part):
            where = getattr(loaded, "__file__", None) or module
            raise ConfigError(f"{origin}: {where} defines no {attr!r}; {_example(kind)}", field=field)
        value = getattr(value, part) if part else value
    return value


def import_module(module: str) -> Any:
    """`importlib.import_module`, with the current folder on the path (last) as ``python -m`` has it."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)
        importlib.invalidate_caches()
    return importlib.import_module(module)


def _example(kind: str) -> str:
    return {
        "method": "a method of your own is a module defining SPEC = fedmq.fedcore.algorithms.base.AlgorithmSpec(...),"
        " named as method.name: my_package.my_method (docs/plugins.md)",
        "model": "a model of your own is an nn.Module class (or a function returning one) called as"
        " NAME(input_shape, num_classes, **options), named as model.name: my_package.nets:MyNet (docs/plugins.md)",
        "dataset": "a dataset of your own is a function returning fedmq.fedcore.data.Split(train, test), named as"
        " data.dataset: my_package.data:load (docs/plugins.md)",
    }[kind]


def _unknown(name: str, kind: str, builtins: list[str], eps: dict[str, metadata.EntryPoint]) -> str:
    """What `name` was looked up as: the built-in names (the message older versions gave) and the entry points."""
    installed = f" (installed: {', '.join(sorted(eps))})" if eps else " (none installed)"
    available = ", ".join(sorted(builtins))
    return f"unknown {kind} {name!r}; available: {available}; no {GROUPS[kind]} entry point of that name{installed}"
