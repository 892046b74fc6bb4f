"""The digits read from scikit-learn's packaged file without importing scikit-learn: its arrays, bit for bit."""

from __future__ import annotations

import numpy as np

from fedmq.fedcore.datasets.digits import digits_arrays, packaged_digits_file
from tests.interpreter import fresh_python


def test_digits_read_from_the_packaged_file_are_sklearns_load_digits_bitwise() -> None:
    from sklearn.datasets import load_digits

    assert packaged_digits_file() is not None, "the installed scikit-learn keeps digits.csv.gz elsewhere"
    images, target = digits_arrays()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert target.dtype == bunch.target.dtype and np.array_equal(target, bunch.target)


def test_loading_the_digits_imports_no_sklearn() -> None:
    """A daemon on the digits (the quickstart's) does not pay scikit-learn's import (1.6 s here)."""
    code = (
        "import sys\n"
        "from fedmq.fedcore.data import load_dataset\n"
        "split = load_dataset('digits', seed=0)\n"
        "print(len(split.train) + len(split.test), 'sklearn' in sys.modules)\n"
    )
    assert fresh_python(code).split() == ["1797", "False"]
