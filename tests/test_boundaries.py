"""Package boundaries (STYLE.md section 1), checked by parsing every import.

broker/ knows nothing of learning; fedcore/ nothing of transport; the daemons use the bus and the
core's interfaces and know no algorithm by name; nothing imports pickle or torchvision. Every
first-party import goes through the one import name, `fedmq` (`fedmq.broker`, never `broker`).
Under them all lie `fedmq.fields` (the bounds of config fields) and `fedmq.malloc` (glibc's settings for the
process, which the bus and the training both ask for), which every layer may import.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
FORBIDDEN_EVERYWHERE = {"pickle", "cloudpickle", "dill", "marshal", "shelve", "torchvision"}

ALLOWED: dict[str, set[str]] = {
    "broker": {
        "broker",
        "aiomqtt",
        "paho",
        "msgpack",
        "numpy",
        "amqtt",
        "xxhash",
        "cryptography",
        "argon2",
        "prometheus_client",
    },
    "fedcore": {
        "fedcore",
        "torch",
        "numpy",
        "sklearn",
        "PIL",
        "torchvision",
        "safetensors",
        "opacus",
        "cryptography",
        "Crypto",  # secure aggregation's X25519, HKDF, AES and Shamir sharing (fedcore/secagg.py)
    },
    "coordinator": {
        "coordinator",
        "broker",
        "fedcore",
        "torch",
        "numpy",
        "safetensors",
        "aiohttp",
        "prometheus_client",
        "tensorboard",
    },
    "fednode": {"fednode", "broker", "fedcore", "torch", "numpy", "aiohttp", "prometheus_client"},
    # the site aggregator is a node upstream and a coordinator downstream: it composes the two daemons
    "aggregator": {"aggregator", "coordinator", "fednode", "broker", "fedcore", "torch", "numpy"},
}
# only these modules may use the optional third-party pieces
NARROW = {
    "amqtt": {"broker/servers/embedded.py"},
    "xxhash": {"broker/codec.py"},  # the frame checksum
    # the federation's CA and the broker's certificate; secure aggregation's X25519, HKDF and AES
    "cryptography": {"broker/servers/provision.py", "fedcore/secagg.py"},
    "Crypto": {"fedcore/secagg.py"},  # pycryptodome's Shamir sharing (secure aggregation)
    "argon2": {"broker/servers/provision.py"},  # amqtt's password hashes (amqtt depends on it)
    "sklearn": {"fedcore/datasets/digits.py"},  # its loader, where its packaged digits file is elsewhere
    "opacus": {"fedcore/privacy.py"},  # the privacy accountant (the privacy extra)
    "PIL": {"fedcore/datasets/images.py"},  # image decoding (WebP packs, PNG/JPEG folders)
    "torchvision": {"fedcore/datasets/download.py"},  # see EXCEPTIONS
    # checkpoints, KDIA's disk store
    "safetensors": {"coordinator/storage/run_dir.py", "fedcore/algorithms/kdia/teacher.py"},
    # the HTTP API and dashboard, a node host's /metrics
    "aiohttp": {"coordinator/observers/http.py", "fednode/metrics.py"},
    "prometheus_client": {"coordinator/observers/metrics.py", "fednode/metrics.py", "broker/prometheus.py"},
    "tensorboard": {"coordinator/observers/tensorboard.py"},  # optional: fedmq[tensorboard]
}
# The only exceptions to FORBIDDEN_EVERYWHERE: the opt-in `data.download` imports torchvision inside
# one function (never at module level: the core must import without it); the CIFAR pickles are read
# by fedcore/datasets/safe_unpickle.py, which interprets the opcodes itself and needs no exception.
EXCEPTIONS = {"torchvision": {"fedcore/datasets/download.py"}}

# The floor every layer may import: `fedmq.fields` (`Bounds`, `check_fields`), so that the bus's settings
# and the core's (`TrainSettings`, `Staleness`, `Compression`) declare their bounds the same way, and the
# experiment file derives its sections from them, without broker and fedcore importing each other; and
# `fedmq.malloc`, glibc's settings for the process, which the bus's chunk buffers and the training's tensors
# both ask for. Each imports only the standard library (test_floor_imports_only_the_standard_library).
FLOOR = {"fields", "malloc"}

FIRST_PARTY = {"broker", "coordinator", "fednode", "aggregator", "fedcore", "experiments"}


def layer(name: str) -> str:
    """`fedmq.broker.codec` -> `broker.codec`: our modules named by their folder, others as they are."""
    return name.removeprefix("fedmq.") if name.startswith("fedmq.") else name


def raw_imports(path: Path) -> set[str]:
    """The absolute imports of `path`, as written."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imports(path: Path) -> set[str]:
    """The imports of `path`, ours named by their folder (`broker.codec` for `fedmq.broker.codec`)."""
    return {layer(name) for name in raw_imports(path)}


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_first_party_imports_go_through_fedmq() -> None:
    """A bare `import broker` would find whatever `broker` comes first on sys.path: a user's own
    folder of that name, or another distribution's package. Ours are reached as `fedmq.broker`."""
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for folder in (*FIRST_PARTY, "tests", "fedmq")
        for path in sources(folder)
        for name in raw_imports(path)
        if name.split(".")[0] in FIRST_PARTY
    ]
    assert not offenders, "first-party imports without the fedmq prefix:\n" + "\n".join(offenders)


def test_fedmq_links_the_design_card_folders() -> None:
    """fedmq/ holds the links through which the folders at the top of the repository are its subpackages."""
    links = {path.name: path for path in (ROOT / "fedmq").iterdir() if path.is_symlink()}
    assert set(links) == FIRST_PARTY
    assert all(links[name].resolve() == (ROOT / name).resolve() for name in links)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_what_its_layer_allows(package: str) -> None:
    violations = []
    for path in sources(package):
        rel = str(path.relative_to(ROOT))
        for name in imports(path):
            top = name.split(".")[0]
            if top in STDLIB and top not in FORBIDDEN_EVERYWHERE:
                continue
            if name in FLOOR:
                continue
            if top not in ALLOWED[package] or (top in NARROW and rel not in NARROW[top]):
                violations.append(f"{rel}: {name}")
    assert not violations, "imports across layer boundaries:\n" + "\n".join(violations)


@pytest.mark.parametrize("module", sorted(FLOOR))
def test_floor_imports_only_the_standard_library(module: str) -> None:
    """The floor lies under every layer: importing anything of ours, or a third party's, would carry it into all."""
    path = ROOT / "fedmq" / f"{module}.py"
    outside = sorted(name for name in raw_imports(path) if name.split(".")[0] not in STDLIB)
    assert not outside, f"fedmq/{module}.py imports beyond the standard library: {outside}"


def test_daemons_know_no_algorithm_by_name() -> None:
    """coordinator/, fednode/ and aggregator/ reach algorithms only through fedcore.algorithms.base, and name the
    half they were given only through fedcore.algorithms.fingerprint (which asks the registry)."""
    offenders = []
    generic = ("fedcore.algorithms.base", "fedcore.algorithms.fingerprint")
    for package in ("coordinator", "fednode", "aggregator"):
        for path in sources(package):
            for name in imports(path):
                if name.startswith("fedcore.algorithms") and name not in generic:
                    offenders.append(f"{path.relative_to(ROOT)}: {name}")
            if "fedavg" in path.read_text().lower():
                offenders.append(f"{path.relative_to(ROOT)} mentions fedavg")
    assert not offenders, offenders


def test_nothing_imports_pickle_or_torchvision() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in [*ALLOWED, "experiments"]
        for path in sources(package)
        for name in imports(path)
        if name.split(".")[0] in FORBIDDEN_EVERYWHERE
        and str(path.relative_to(ROOT)) not in EXCEPTIONS.get(name.split(".")[0], set())
    ]
    assert not offenders, offenders


def test_exceptions_import_only_inside_functions() -> None:
    """The excepted imports (torchvision for downloads) happen lazily, never when the module is imported."""
    offenders = []
    for top, files in EXCEPTIONS.items():
        for rel in files:
            tree = ast.parse((ROOT / rel).read_text())
            lazy = {
                id(node)
                for func in ast.walk(tree)
                if isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
                for node in ast.walk(func)
            }
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n.split(".")[0] == top for n in names) and id(node) not in lazy:
                    offenders.append(f"{rel}: module-level import of {top}")
    assert not offenders, offenders


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """Our modules that `path` imports when it is imported: module level, including `if TYPE_CHECKING:` and
    `try:` blocks (a type-only cycle still ties two modules together), not imports inside functions. `from
    pkg import sub` counts as an import of `pkg.sub`, not of the package's `__init__`."""
    name = _module_name(path)
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(layer(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = layer(node.module or "") if node.level == 0 else node.module or ""
                if node.level:
                    package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join([*package, base] if base else package)
                subs = {f"{base}.{alias.name}" for alias in node.names} & modules
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(base)
            elif isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return (found & modules) - {name}


def test_no_import_cycles() -> None:
    """No two of our modules import each other, directly or around a circle (issue 20 found two:
    experiments.cli <-> experiments.runner, fednode.groups <-> fednode.workspace)."""
    paths = {_module_name(p): p for pkg in (*ALLOWED, "experiments") for p in (ROOT / pkg).rglob("*.py")}
    graph = {name: _module_level_imports(path, set(paths)) for name, path in paths.items()}
    cycles = []
    for start in graph:  # a depth-first walk from each module, back to it
        stack = [(start, [start])]
        seen: set[str] = set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not cycles, "import cycles:\n" + "\n".join(sorted(set(cycles)))


def _classes_of(package: str) -> list[type]:
    """The classes defined in `package`'s modules (imported: inheritance is resolved at run time)."""
    found = []
    for path in sources(package):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__" or "flower_app" in parts:  # the Flower app runs in Flower's own venv
            continue
        name = ".".join(("fedmq", *(parts[:-1] if parts[-1] == "__init__" else parts)))
        module = importlib.import_module(name)
        found += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__]
    return found


def _package_of(cls: type) -> str | None:
    parts = cls.__module__.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "fedmq" and parts[1] in FIRST_PARTY else None


@pytest.mark.parametrize("package", sorted(FIRST_PARTY))
def test_no_private_method_is_overridden_across_packages(package: str) -> None:
    """Reuse across packages goes through constructors and public methods (issue 30): a subclass that
    overrides another package's private step (the site aggregator overrode eight of the daemons') breaks
    silently when that step changes. Within a package, a base and its subclasses change together."""
    offenders = []
    for cls in _classes_of(package):
        for base in cls.__mro__[1:]:
            theirs = _package_of(base)
            if theirs is None or theirs == package:
                continue
            private = {n for n in vars(cls) if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}
            offenders += [
                f"{cls.__module__}.{cls.__qualname__}.{n} overrides {base.__module__}"
                for n in private & set(vars(base))
            ]
    assert not offenders, "private methods overridden across packages:\n" + "\n".join(sorted(offenders))
