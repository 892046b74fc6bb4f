"""scikit-learn's 8x8 digits, read as its `load_digits` reads them, without importing scikit-learn.

Why: importing sklearn (scipy.stats and the rest of its import chain) took 1.6 s of every process that
loaded the digits on a 2-core CPU (2026-11-28, `python -m cProfile` of a node daemon): each coordinator
and node daemon on the quickstart's data paid it before its first round. The dataset is a file that
ships inside the package (`sklearn/datasets/data/digits.csv.gz`); `sklearn.datasets.load_digits` reads
it with `np.loadtxt(..., delimiter=",")`, which is done here on the same file, giving the same arrays
bit for bit (tests/fedcore/test_digits.py). Where the file is not where this version keeps it,
scikit-learn's own loader runs.
"""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np


def packaged_digits_file() -> Path | None:
    """Where the installed scikit-learn keeps the digits, found without importing it; None if not there."""
    spec = importlib.util.find_spec("sklearn")  # a top-level package: located, not imported
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits' images (1797, 8, 8), float64 in 0..16, and their labels (1797,), as
    `sklearn.datasets.load_digits()` gives `images` and `target`."""
    path = packaged_digits_file()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, mode="rt", encoding="utf-8") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int, copy=False)
