"""Writes pickles the way Python 2's cPickle wrote the CIFAR files (protocol 2), without the pickle module.

Enough for test fixtures: dicts, lists, ints, byte strings (Python 2 str) and numpy arrays pickled
as numpy does (``_reconstruct`` then BUILD with the raw bytes), with memo entries and a BINGET of
the shared dtype as cPickle emits them.
"""

from __future__ import annotations

import struct

import numpy as np


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")
        self.memo = 0
        self.dtypes: dict[str, int] = {}

    def put(self) -> int:
        self.memo += 1
        self.out += b"q" + bytes([self.memo]) if self.memo < 256 else b"r" + struct.pack("<I", self.memo)
        return self.memo

    def get(self, key: int) -> None:
        self.out += b"h" + bytes([key]) if key < 256 else b"j" + struct.pack("<I", key)

    def string(self, value: bytes) -> None:
        if len(value) < 256:
            self.out += b"U" + bytes([len(value)]) + value
        else:
            self.out += b"T" + struct.pack("<i", len(value)) + value

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        else:
            self.out += b"J" + struct.pack("<i", value)

    def dtype(self, dtype: np.dtype) -> None:
        code = f"{dtype.kind}{dtype.itemsize}"
        if code in self.dtypes:
            self.get(self.dtypes[code])
            return
        self.out += b"cnumpy\ndtype\n"
        self.put()
        self.string(code.encode())
        self.out += b"K\x00K\x01\x87R"
        self.dtypes[code] = self.put()
        self.out += b"(K\x03"
        self.string(b"|" if dtype.itemsize == 1 else b"<")
        self.out += b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"

    def array(self, value: np.ndarray) -> None:
        self.out += b"cnumpy.core.multiarray\n_reconstruct\n"
        self.put()
        self.out += b"cnumpy\nndarray\n"
        self.put()
        self.out += b"K\x00\x85"
        self.string(b"b")
        self.out += b"\x87R"
        self.put()
        self.out += b"(K\x01("
        for d in value.shape:
            self.integer(d)
        self.out += b"t"
        self.dtype(value.dtype)
        self.out += b"\x89"
        self.string(np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes())
        self.out += b"tb"

    def value(self, value: object) -> None:
        if isinstance(value, dict):
            self.out += b"}"
            self.put()
            self.out += b"("
            for k, v in value.items():
                self.value(k)
                self.value(v)
            self.out += b"u"
        elif isinstance(value, list):
            self.out += b"]"
            self.put()
            self.out += b"("
            for v in value:
                self.value(v)
            self.out += b"e"
        elif isinstance(value, bool):
            self.out += b"\x88" if value else b"\x89"
        elif isinstance(value, int):
            self.integer(value)
        elif isinstance(value, str):
            self.string(value.encode("latin-1"))
        elif isinstance(value, bytes):
            self.string(value)
        elif isinstance(value, np.ndarray):
            self.array(value)
        elif value is None:
            self.out += b"N"
        else:
            raise TypeError(f"cannot write {type(value).__name__}")


def dumps_py2(value: object) -> bytes:
    """`value` as cPickle protocol 2 bytes (str keys and values are written as Python 2 str)."""
    writer = _Writer()
    writer.value(value)
    writer.out += b"."
    return bytes(writer.out)
