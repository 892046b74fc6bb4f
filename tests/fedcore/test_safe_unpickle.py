"""The data-only pickle reader: CIFAR-style pickles come back as plain data, anything else is refused unexecuted."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from fedmq.fedcore.datasets.safe_unpickle import RefusedPickleError, UnpicklingError, loads
from tests.fedcore.py2pickle import dumps_py2


def test_loads_cifar_style_batch_returns_arrays_lists_and_bytes() -> None:
    """A cPickle protocol-2 CIFAR batch: uint8 data array, int labels, Python 2 strings as bytes."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (7, 3072), dtype=np.uint8)
    other = rng.integers(0, 256, (2, 5), dtype=np.uint8)  # the second array reuses the memoised dtype
    blob = dumps_py2(
        {"batch_label": "training batch 1 of 5", "labels": [3, 1, 4, 1, 5, 9, 2], "data": data, "x": other}
    )
    out = loads(blob)
    assert isinstance(out, dict) and set(out) == {b"batch_label", b"labels", b"data", b"x"}
    assert out[b"labels"] == [3, 1, 4, 1, 5, 9, 2] and out[b"batch_label"] == b"training batch 1 of 5"
    assert out[b"data"].dtype == np.uint8 and np.array_equal(out[b"data"], data)
    assert np.array_equal(out[b"x"], other)


@pytest.mark.parametrize("dtype", ["<i8", "<f4", "<f8", "|b1", "<u2"])
def test_loads_numeric_arrays_keep_dtype_and_values(dtype: str) -> None:
    """Numeric dtypes other than uint8 round-trip with their values."""
    value = (np.arange(12) % 3).astype(dtype).reshape(3, 4)
    out = loads(dumps_py2({"a": value}))[b"a"]
    assert out.dtype == value.dtype and np.array_equal(out, value)


def test_loads_real_batches_meta_gives_cifar10_label_names(data_root: Path) -> None:
    """The official batches.meta (a real CIFAR pickle) reads as its dict of names and sizes."""
    meta = loads((data_root / "cifar10" / "batches.meta").read_bytes())
    assert meta == {
        b"num_cases_per_batch": 10000,
        b"label_names": [
            b"airplane",
            b"automobile",
            b"bird",
            b"cat",
            b"deer",
            b"dog",
            b"frog",
            b"horse",
            b"ship",
            b"truck",
        ],
        b"num_vis": 3072,
    }


def _marker_command(marker: Path) -> bytes:
    return f"touch {marker}".encode()


MALICIOUS = {
    # protocol 0: GLOBAL os.system, then REDUCE: what `pickle.loads` would execute
    "global-os-system": lambda cmd: b"cos\nsystem\n(S'" + cmd + b"'\ntR.",
    # the same through posix.system, the real module name
    "global-posix-system": lambda cmd: b"cposix\nsystem\n(S'" + cmd + b"'\ntR.",
    # protocol 4: STACK_GLOBAL
    "stack-global": lambda cmd: b"\x80\x04\x8c\x02os\x8c\x06system\x93\x8c" + bytes([len(cmd)]) + cmd + b"\x85R.",
    # INST: instantiate os.system with arguments from the stack
    "inst": lambda cmd: b"(S'" + cmd + b"'\nios\nsystem\n.",
    # builtins.eval and exec
    "eval": lambda cmd: b'cbuiltins\neval\n(S\'__import__("os").system("' + cmd + b"\")'\ntR.",
    # an allowed global called with a forged subtype: _reconstruct(os.system, ...)
    "reconstruct-other-class": lambda cmd: (
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\ncos\nsystem\nK\x00\x85U\x01b\x87R."
    ),
    # NEWOBJ on an allowed marker
    "newobj": lambda cmd: b"\x80\x02cnumpy\nndarray\n)\x81.",
    # the extension registry
    "ext1": lambda cmd: b"\x80\x02\x82\x01.",
    # persistent id
    "persid": lambda cmd: b"P" + cmd + b"\n.",
}


@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_loads_malicious_pickle_is_refused_not_executed(name: str, tmp_path: Path) -> None:
    """A pickle that would run a shell command under pickle.loads raises RefusedPickleError and runs nothing."""
    marker = tmp_path / "pwned"
    with pytest.raises(RefusedPickleError):
        loads(MALICIOUS[name](_marker_command(marker)))
    assert not marker.exists()


def test_loads_object_dtype_is_refused() -> None:
    """numpy object arrays (whose elements would be arbitrary pickles) are refused."""
    blob = b"\x80\x02cnumpy\ndtype\nU\x02O8K\x00K\x01\x87R."
    with pytest.raises(RefusedPickleError, match="dtype"):
        loads(blob)


def test_loads_reduce_on_plain_value_is_refused() -> None:
    """REDUCE may call only the allowed markers, not whatever the stack holds."""
    with pytest.raises(RefusedPickleError, match="REDUCE"):
        loads(b"\x80\x02]K\x01\x85R.")


@pytest.mark.parametrize(
    "blob",
    [
        b"\x80\x02T" + struct.pack("<i", 1_000_000) + b"abc.",  # length past the end
        b"\x80\x02}(U\x01a",  # no STOP
        b"\x80\x02K\x01K\x02.",  # two values left on the stack
        b"\x80\x02h\x07.",  # memo key never defined
        b"\x80\x02(]K\x01u.",  # SETITEMS on a list
    ],
)
def test_loads_malformed_pickle_raises_unpickling_error(blob: bytes) -> None:
    """Truncated or inconsistent input is an UnpicklingError, never an IndexError or a huge allocation."""
    with pytest.raises(UnpicklingError):
        loads(blob)


def test_loads_array_with_wrong_byte_count_is_rejected() -> None:
    """An array whose raw bytes do not match shape x itemsize is rejected."""
    blob = bytearray(dumps_py2({"a": np.zeros((2, 3), dtype=np.uint8)}))
    blob = blob.replace(b"U\x06\x00\x00\x00\x00\x00\x00", b"U\x05\x00\x00\x00\x00\x00")
    with pytest.raises(UnpicklingError, match="needs 6 bytes"):
        loads(bytes(blob))


def test_loads_shared_references_are_finished_once() -> None:
    """60 nested lists each holding the previous one twice (2^60 paths) load at once, sharing stays shared."""
    blob = bytearray(b"\x80\x02]q\x000")
    for i in range(60):
        blob += b"](h" + bytes([i]) + b"h" + bytes([i]) + b"eq" + bytes([i + 1]) + b"0"
    out = loads(bytes(blob + b"h" + bytes([60]) + b"."))
    assert isinstance(out, list) and len(out) == 2 and out[0] is out[1]


def test_loads_self_referencing_list_is_allowed() -> None:
    """A list that contains itself (legal in pickle) comes back as such, without endless recursion."""
    out = loads(b"\x80\x02]q\x00h\x00a.")
    assert isinstance(out, list) and out[0] is out
