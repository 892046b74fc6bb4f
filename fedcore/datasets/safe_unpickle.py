"""A data-only pickle reader for the CIFAR "python version" files, without the pickle module.

CIFAR-10 and CIFAR-100 are distributed as pickles (Python 2 cPickle, protocol 2) holding a dict of
byte strings, lists of ints and uint8 numpy arrays. `pickle.load` on such a file would run
whatever callable the file names, so this module interprets the pickle opcodes itself and builds
only plain data: None, bools, ints, floats, str, bytes, tuples, lists, dicts, sets, and numeric
numpy arrays.

How it stays safe:
- every opcode that creates an arbitrary object (INST, OBJ, NEWOBJ, NEWOBJ_EX, the extension
  registry, persistent ids, out-of-band buffers) is refused, as is any opcode it does not know;
- GLOBAL / STACK_GLOBAL resolve only the names numpy's array pickling uses, and resolve them to
  inert markers, not to the real functions: REDUCE and BUILD on a marker run this module's own
  code (an array is made with `np.frombuffer` from validated bytes, dtype and shape), and on
  anything else they are refused;
- only numeric dtypes (bool, int, uint, float, complex) are accepted: never `object`;
- lengths are checked against the bytes that are left, so a forged length cannot allocate.

Python 2 strings (STRING, BINSTRING, SHORT_BINSTRING) come back as `bytes`, as with
``encoding="bytes"``; the caller decodes keys it knows are text.
"""

from __future__ import annotations

import ast
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class UnpicklingError(ValueError):
    """The data is not a well-formed pickle."""


class RefusedPickleError(UnpicklingError):
    """The pickle asks for something other than plain data (for instance a call to an arbitrary function)."""


@dataclass(frozen=True, slots=True)
class _Global:
    """An allowed global, resolved to a name only: it is never a real callable."""

    name: str


_RECONSTRUCT = _Global("numpy._reconstruct")
_NDARRAY = _Global("numpy.ndarray")
_DTYPE = _Global("numpy.dtype")
_FROMBUFFER = _Global("numpy._frombuffer")
_ENCODE = _Global("_codecs.encode")
_SET = _Global("set")
_FROZENSET = _Global("frozenset")

ALLOWED_GLOBALS: dict[tuple[str, str], _Global] = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _DTYPE,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("_codecs", "encode"): _ENCODE,  # how Python 3 writes bytes at protocols 0-2
    ("__builtin__", "set"): _SET,  # sets at protocols 0-3
    ("builtins", "set"): _SET,
    ("__builtin__", "frozenset"): _FROZENSET,
    ("builtins", "frozenset"): _FROZENSET,
}

_DTYPE_CODE = re.compile(r"^[biufc]\d{1,2}$")
_MAX_LONG_BYTES = 64
_MAX_DEPTH = 64


class _DtypeBox:
    """A dtype under construction: numpy pickles it as dtype(code) followed by BUILD(state)."""

    __slots__ = ("byteorder", "code")

    def __init__(self, code: str) -> None:
        self.code = code
        self.byteorder = "|"

    def resolve(self) -> np.dtype[Any]:
        dtype = np.dtype(self.code)
        return dtype.newbyteorder(self.byteorder) if self.byteorder in "<>" else dtype  # type: ignore[arg-type]


class _ArrayBox:
    """An array under construction: `_reconstruct(ndarray, ...)` then BUILD with shape, dtype and bytes."""

    __slots__ = ("array",)

    def __init__(self) -> None:
        self.array: np.ndarray | None = None


class _Mark:
    pass


_MARK = _Mark()


def _dtype_from(value: object) -> np.dtype[Any]:
    if isinstance(value, _DtypeBox):
        return value.resolve()
    raise RefusedPickleError(f"array dtype must be a numeric numpy dtype, got {type(value).__name__}")


def _array_from_bytes(raw: object, dtype: np.dtype[Any], shape: object, fortran: bool) -> np.ndarray:
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise RefusedPickleError("array data must be raw bytes (object arrays are refused)")
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise UnpicklingError(f"bad array shape {shape!r}")
    count = 1
    for d in shape:
        count *= d
    if len(raw) != count * dtype.itemsize:
        raise UnpicklingError(
            f"array of shape {shape} and dtype {dtype} needs {count * dtype.itemsize} bytes, got {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _call(func: object, args: object) -> object:
    """REDUCE: only the allowed markers, each with arguments of the exact expected form."""
    if not isinstance(func, _Global):
        raise RefusedPickleError(f"REDUCE on {type(func).__name__} is refused: only numpy array pickling is allowed")
    if not isinstance(args, tuple):
        raise UnpicklingError("REDUCE arguments must be a tuple")
    if func is _RECONSTRUCT:
        if len(args) != 3 or args[0] is not _NDARRAY:
            raise RefusedPickleError("_reconstruct is allowed only for numpy.ndarray")
        return _ArrayBox()
    if func is _DTYPE:
        code = args[0] if args else None
        if isinstance(code, bytes):
            code = code.decode("ascii", "replace")
        if not isinstance(code, str) or not _DTYPE_CODE.match(code):
            raise RefusedPickleError(f"dtype {code!r} is refused: only bool, int, uint, float and complex")
        return _DtypeBox(code)
    if func is _FROMBUFFER:
        if len(args) != 4:
            raise UnpicklingError("_frombuffer takes (buffer, dtype, shape, order)")
        buf, dtype, shape, order = args
        return _array_from_bytes(buf, _dtype_from(dtype), shape, order == "F")
    if func is _ENCODE:
        if len(args) != 2 or not isinstance(args[0], str) or args[1] not in ("latin1", "latin-1"):
            raise RefusedPickleError("_codecs.encode is allowed only as encode(str, 'latin1')")
        return args[0].encode("latin-1")
    if func is _SET or func is _FROZENSET:
        if len(args) > 1 or (args and not isinstance(args[0], list)):
            raise RefusedPickleError(f"{func.name} is allowed only on a list")
        try:
            return (set if func is _SET else frozenset)(args[0] if args else ())
        except TypeError as exc:
            raise UnpicklingError(f"unhashable set item: {exc}") from None
    raise RefusedPickleError(f"{func.name} cannot be called")


def _build(obj: object, state: object) -> None:
    """BUILD: only on a dtype or array under construction."""
    if isinstance(obj, _DtypeBox):
        if not isinstance(state, tuple) or len(state) < 2 or not isinstance(state[1], str | bytes):
            raise UnpicklingError("bad dtype state")
        order = state[1].decode("ascii", "replace") if isinstance(state[1], bytes) else state[1]
        if order not in ("|", "<", ">", "="):
            raise UnpicklingError(f"bad dtype byte order {order!r}")
        if any(s is not None for s in state[2:5]):
            raise RefusedPickleError("structured dtypes are refused")
        obj.byteorder = order
        return
    if isinstance(obj, _ArrayBox):
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise UnpicklingError("bad array state")
        _, shape, dtype, fortran, raw = state if len(state) == 5 else (1, *state)
        obj.array = _array_from_bytes(raw, _dtype_from(dtype), shape, bool(fortran))
        return
    raise RefusedPickleError(f"BUILD on {type(obj).__name__} is refused: only numpy arrays and dtypes")


def _finish(value: object, done: dict[int, object], depth: int = 0) -> object:
    """Replace the boxes by the arrays they hold; each shared container is visited once (`done`, by id)."""
    if depth > _MAX_DEPTH:
        raise UnpicklingError("nesting too deep")
    if isinstance(value, _ArrayBox):
        if value.array is None:
            raise UnpicklingError("an array was never given its data")
        return value.array
    if isinstance(value, _DtypeBox):
        return value.resolve()
    if isinstance(value, _Global):
        raise RefusedPickleError(f"a bare reference to {value.name} is refused")
    if isinstance(value, set | frozenset):
        if any(isinstance(v, _Global | _ArrayBox | _DtypeBox) for v in value):
            raise RefusedPickleError("sets may hold only plain values")
        return value
    if not isinstance(value, list | tuple | dict):
        return value
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, list):
        done[id(value)] = value  # lists and dicts are updated in place, so a cycle finds the same object
        value[:] = [_finish(v, done, depth + 1) for v in value]
        return value
    if isinstance(value, dict):
        done[id(value)] = value
        items = [(_finish(k, done, depth + 1), _finish(v, done, depth + 1)) for k, v in value.items()]
        value.clear()
        value.update(items)
        return value
    out = tuple(_finish(v, done, depth + 1) for v in value)
    done[id(value)] = out
    return out


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.raw = data if isinstance(data, bytes) else bytes(data)
        self.data = memoryview(self.raw)
        self.pos = 0
        self.stack: list[Any] = []
        self.memo: dict[int, Any] = {}

    # -- raw input -------------------------------------------------------------------------
    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            raise UnpicklingError(f"truncated pickle: {n} bytes wanted at offset {self.pos}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def line(self) -> bytes:
        end = self.raw.find(b"\n", self.pos)
        if end < 0:
            raise UnpicklingError(f"unterminated line at offset {self.pos}")
        out = self.raw[self.pos : end]
        self.pos = end + 1
        return out

    def u(self, fmt: str) -> int:
        (value,) = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return int(value)

    # -- stack -----------------------------------------------------------------------------
    def pop(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise UnpicklingError("stack underflow")
        return self.stack.pop()

    def pop_mark(self) -> list[Any]:
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i] is _MARK:
                items = self.stack[i + 1 :]
                del self.stack[i:]
                return items
        raise UnpicklingError("no MARK on the stack")

    def top(self) -> Any:
        if not self.stack or self.stack[-1] is _MARK:
            raise UnpicklingError("stack underflow")
        return self.stack[-1]

    def get(self, key: int) -> None:
        if key not in self.memo:
            raise UnpicklingError(f"memo key {key} is not defined")
        self.stack.append(self.memo[key])

    def put(self, key: int) -> None:
        self.memo[key] = self.top()

    def global_(self, module: str, name: str) -> None:
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None:
            raise RefusedPickleError(f"global {module}.{name} is refused: only numpy array pickling is allowed")
        self.stack.append(found)

    def setitems(self, target: Any, items: list[Any]) -> None:
        if not isinstance(target, dict) or len(items) % 2:
            raise UnpicklingError("SETITEMS needs a dict and key/value pairs")
        for k, v in zip(items[::2], items[1::2], strict=True):
            try:
                target[k] = v
            except TypeError as exc:
                raise UnpicklingError(f"unhashable dict key: {exc}") from None

    def appends(self, target: Any, items: list[Any]) -> None:
        if not isinstance(target, list):
            raise UnpicklingError("APPEND needs a list")
        target.extend(items)

    # -- the loop --------------------------------------------------------------------------
    def run(self) -> object:
        ops = self.opcodes()
        while True:
            code = self.take(1)[0]
            if code == 0x2E:  # STOP
                if len(self.stack) != 1:
                    raise UnpicklingError("STOP with a malformed stack")
                return _finish(self.stack.pop(), {})
            op = ops.get(code)
            if op is None:
                raise RefusedPickleError(f"opcode {bytes([code])!r} at offset {self.pos - 1} is not allowed")
            op()

    def opcodes(self) -> dict[int, Callable[[], None]]:
        s, push = self.stack, self.stack.append

        def proto() -> None:
            if self.take(1)[0] > 5:
                raise UnpicklingError("unsupported pickle protocol")

        def frame() -> None:
            self.take(8)  # a length hint only: the opcodes that follow are read as usual

        def int_() -> None:
            text = self.line()
            push(text == b"01" if text in (b"00", b"01") else self._int(text))

        def long_() -> None:
            push(self._int(self.line().rstrip(b"L")))

        def long_n(size_fmt: str) -> Callable[[], None]:
            def op() -> None:
                n = self.u(size_fmt)
                if n > _MAX_LONG_BYTES:
                    raise UnpicklingError("integer too long")
                push(int.from_bytes(self.take(n), "little", signed=True))

            return op

        def string() -> None:
            text = self.line()
            if len(text) < 2 or text[0] not in b"'\"" or text[-1] != text[0]:
                raise UnpicklingError("bad STRING literal")
            try:
                push(ast.literal_eval("b" + text.decode("latin-1")))
            except (ValueError, SyntaxError) as exc:
                raise UnpicklingError(f"bad STRING literal: {exc}") from None

        def sized(fmt: str, kind: Callable[[memoryview], object]) -> Callable[[], None]:
            return lambda: push(kind(self.take(self.u(fmt))))

        def text(view: memoryview) -> str:
            try:
                return str(view, "utf-8", "surrogatepass")
            except UnicodeDecodeError as exc:
                raise UnpicklingError(f"bad UTF-8 string: {exc}") from None

        def unicode_() -> None:
            push(self.line().decode("raw-unicode-escape"))

        def float_() -> None:
            try:
                push(float(self.line()))
            except ValueError as exc:
                raise UnpicklingError(str(exc)) from None

        def tuple_n(n: int) -> Callable[[], None]:
            def op() -> None:
                if len(s) < n or any(v is _MARK for v in s[len(s) - n :]):
                    raise UnpicklingError("stack underflow")
                items = tuple(s[len(s) - n :])
                del s[len(s) - n :]
                push(items)

            return op

        def dict_() -> None:
            d: dict[Any, Any] = {}
            self.setitems(d, self.pop_mark())
            push(d)

        def setitem() -> None:
            v = self.pop()
            k = self.pop()
            self.setitems(self.top(), [k, v])

        def append() -> None:
            v = self.pop()
            self.appends(self.top(), [v])

        def additems() -> None:
            items = self.pop_mark()
            target = self.top()
            if not isinstance(target, set):
                raise UnpicklingError("ADDITEMS needs a set")
            try:
                target.update(items)
            except TypeError as exc:
                raise UnpicklingError(f"unhashable set item: {exc}") from None

        def frozenset_() -> None:
            try:
                push(frozenset(self.pop_mark()))
            except TypeError as exc:
                raise UnpicklingError(f"unhashable set item: {exc}") from None

        def global_text() -> None:
            module = self.line().decode("utf-8", "replace")
            name = self.line().decode("utf-8", "replace")
            self.global_(module, name)

        def stack_global() -> None:
            name = self.pop()
            module = self.pop()
            if not isinstance(module, str) or not isinstance(name, str):
                raise UnpicklingError("STACK_GLOBAL needs two strings")
            self.global_(module, name)

        def reduce_() -> None:
            args = self.pop()
            func = self.pop()
            push(_call(func, args))

        def build() -> None:
            state = self.pop()
            _build(self.top(), state)

        def memoize() -> None:
            self.memo[len(self.memo)] = self.top()

        def dup() -> None:
            push(self.top())

        def pop() -> None:
            if s and s[-1] is _MARK:
                self.pop_mark()
            else:
                self.pop()

        def pop_mark() -> None:
            self.pop_mark()

        def setitems() -> None:
            items = self.pop_mark()
            self.setitems(self.top(), items)

        def appends() -> None:
            items = self.pop_mark()
            self.appends(self.top(), items)

        return {
            0x80: proto,
            0x95: frame,
            ord("("): lambda: push(_MARK),
            ord("0"): pop,
            ord("1"): pop_mark,
            ord("2"): dup,
            ord("N"): lambda: push(None),
            0x88: lambda: push(True),
            0x89: lambda: push(False),
            ord("I"): int_,
            ord("J"): lambda: push(self.u("<i")),
            ord("K"): lambda: push(self.u("<B")),
            ord("M"): lambda: push(self.u("<H")),
            ord("L"): long_,
            0x8A: long_n("<B"),
            0x8B: long_n("<i"),
            ord("F"): float_,
            ord("G"): lambda: push(struct.unpack(">d", self.take(8))[0]),
            ord("S"): string,
            ord("T"): sized("<i", bytes),
            ord("U"): sized("<B", bytes),
            ord("B"): sized("<I", bytes),
            ord("C"): sized("<B", bytes),
            0x8E: sized("<Q", bytes),
            0x96: sized("<Q", bytearray),
            ord("V"): unicode_,
            ord("X"): sized("<I", text),
            0x8C: sized("<B", text),
            0x8D: sized("<Q", text),
            ord("}"): lambda: push({}),
            ord("d"): dict_,
            ord("s"): setitem,
            ord("u"): setitems,
            ord("]"): lambda: push([]),
            ord("l"): lambda: push(self.pop_mark()),
            ord("a"): append,
            ord("e"): appends,
            ord(")"): lambda: push(()),
            ord("t"): lambda: push(tuple(self.pop_mark())),
            0x85: tuple_n(1),
            0x86: tuple_n(2),
            0x87: tuple_n(3),
            0x8F: lambda: push(set()),
            0x90: additems,
            0x91: frozenset_,
            ord("p"): lambda: self.put(self._int(self.line())),
            ord("q"): lambda: self.put(self.u("<B")),
            ord("r"): lambda: self.put(self.u("<I")),
            0x94: memoize,
            ord("g"): lambda: self.get(self._int(self.line())),
            ord("h"): lambda: self.get(self.u("<B")),
            ord("j"): lambda: self.get(self.u("<I")),
            ord("c"): global_text,
            0x93: stack_global,
            ord("R"): reduce_,
            ord("b"): build,
        }

    @staticmethod
    def _int(text: bytes) -> int:
        try:
            return int(text)
        except ValueError:
            raise UnpicklingError(f"bad integer {text[:32]!r}") from None


def loads(data: bytes | bytearray | memoryview) -> object:
    """The plain data in a pickle; `RefusedPickleError` for anything that is not plain data.

    Arrays are read-only views into `data` where possible (no copy).
    """
    return _Reader(data).run()
