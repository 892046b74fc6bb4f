"""Methods that live outside fedmq: a module holding ``SPEC``, or a ``fedmq.methods`` entry point.

``method.name: my_package.my_method`` imports ``my_package.my_method`` and takes its ``SPEC`` (an
`AlgorithmSpec`, as every built-in method module defines); an entry point ``name = module`` or
``name = module:OBJECT`` in the ``fedmq.methods`` group gives it a short name. Built-in names are
looked up first and cannot be replaced (`fedcore.plugins` says what else is tried). The method is
named by what the experiment file wrote, whatever ``SPEC.name`` says, so that every process that
reads the same file (the coordinator, the nodes, a replay) finds it under the same name.

Its code enters the method fingerprint (`source_digest`): a node whose copy of the user's package
differs from the coordinator's is refused, as a node with other hyperparameters is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import types
from collections.abc import Mapping
from pathlib import Path

from fedmq.fedcore import plugins
from fedmq.fedcore.algorithms.base import AlgorithmSpec, CoordinatorHalf, NodeHalf
from fedmq.fedcore.errors import ConfigError

_LOADED: dict[str, AlgorithmSpec] = plugins.cache()
_CODE: dict[str, str] = plugins.cache()
_ORIGIN: dict[str, str] = plugins.cache()
_MODULE: dict[str, str] = plugins.cache()


def load_method(name: str, builtins: Mapping[str, AlgorithmSpec]) -> AlgorithmSpec:
    """The user's method `name` (entry point or module reference), checked and cached for this process."""
    if name in _LOADED:
        return _LOADED[name]
    found = plugins.resolve(name, "method", field="method.name", default_attr="SPEC", builtins=list(builtins))
    spec = _checked(found.value, found.origin, found.module)
    named = dataclasses.replace(spec, name=name)
    _LOADED[name] = named
    _CODE[name] = source_digest(found.module)
    file = getattr(sys.modules.get(found.module), "__file__", None) or found.module
    _ORIGIN[name] = f"{file}, {found.origin}" if found.module != name.partition(":")[0] else file
    _MODULE[name] = found.module
    return named


def loaded() -> Mapping[str, AlgorithmSpec]:
    """The user's methods this process has resolved, by the name the experiment file gave them."""
    return types.MappingProxyType(_LOADED)


def code_of(name: str) -> str | None:
    """The digest of a loaded user method's source (None for a built-in or unknown name)."""
    return _CODE.get(name)


def origin_of(name: str) -> str | None:
    """How a loaded user method was found (entry point or module), for `fedmq methods`."""
    return _ORIGIN.get(name)


def module_of(name: str) -> str | None:
    """The module that holds a loaded user method's SPEC (its docstring is the method's summary)."""
    return _MODULE.get(name)


def installed() -> list[str]:
    """The names of the ``fedmq.methods`` entry points installed (not loaded: `fedmq methods` lists them)."""
    return sorted(plugins.entry_points("method"))


def _checked(spec: object, origin: str, module: str) -> AlgorithmSpec:
    """`spec` if it is a usable AlgorithmSpec, else a ConfigError saying what to fix in `module`."""
    where = getattr(sys.modules.get(module), "__file__", None) or module
    fix = f"in {where}"
    if not isinstance(spec, AlgorithmSpec):
        raise ConfigError(
            f"{origin}: SPEC {fix} is a {type(spec).__name__}, not a fedmq.fedcore.algorithms.base.AlgorithmSpec;"
            " define SPEC = AlgorithmSpec(name=..., hyperparams=Hyperparams, coordinator=CoordinatorHalf,"
            " node=NodeHalf) (docs/plugins.md)",
            field="method.name",
        )
    if not (isinstance(spec.hyperparams, type) and dataclasses.is_dataclass(spec.hyperparams)):
        raise ConfigError(
            f"{origin}: SPEC.hyperparams {fix} must be a dataclass (frozen, keyword-only, every field with a"
            f" default), got {spec.hyperparams!r}",
            field="method.name",
        )
    for half, base in (("coordinator", CoordinatorHalf), ("node", NodeHalf)):
        cls = getattr(spec, half)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(
                f"{origin}: SPEC.{half} {fix} must be a subclass of fedmq.fedcore.algorithms.base.{base.__name__}"
                f" (or of a built-in method's, e.g. fedmq.fedcore.algorithms.fedavg.{base.__name__}), got {cls!r}",
                field="method.name",
            )
    return spec


def source_digest(module: str) -> str:
    """16 hex digits over the source of `module`'s top-level package: every ``.py`` file under it, by its
    path inside the package (so the same code in another folder or machine gives the same digest), or
    the module's one file. The whole package, not one module, because a method's halves may call
    helpers anywhere in it; a node with any other version of the package is refused."""
    top = sys.modules[module.split(".")[0]]
    roots = [Path(p) for p in getattr(top, "__path__", [])]
    digest = hashlib.sha256()
    if roots:
        files = sorted({(str(f.relative_to(root)), f) for root in roots for f in root.rglob("*.py")})
    else:
        file = getattr(top, "__file__", None)
        files = [(Path(file).name, Path(file))] if file else []
    for rel, path in files:
        try:
            data = path.read_bytes()
        except OSError:
            data = b"(unreadable)"
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]
