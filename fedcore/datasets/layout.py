"""Where datasets live under a data root, and the error that says so when they are not there."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fedmq.fedcore.errors import DataError

ROOT_ENV = "FEDMQ_DATA_ROOT"
HOW_TO_SET = (
    f"Set data.root in the experiment file, or the environment variable {ROOT_ENV}, to the folder that holds them"
)


def missing(name: str, root: Path | None, expected: Sequence[str], get: str) -> DataError:
    """A DataError naming the files or folders expected (relative to the data root), where, and how to get them."""
    base = str(root) if root is not None else f"${ROOT_ENV}"
    where = f"under the data root {root}" if root is not None else "(no data root is set)"
    listed = "\n".join(f"  {base}/{item}" for item in expected)
    return DataError(f"dataset {name!r}: not found {where}; expected one of:\n{listed}\n{HOW_TO_SET}. {get}")


def first_existing(root: Path | None, candidates: Sequence[str], *, wanted: Sequence[str] = ()) -> Path | None:
    """The first ``root/candidate`` that exists and holds every name in `wanted`."""
    if root is None:
        return None
    for candidate in candidates:
        path = root / candidate
        if path.exists() and all((path / w).exists() for w in wanted):
            return path
    return None
