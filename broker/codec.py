"""The fedmq wire format: a fixed prefix, a msgpack header, then raw tensor buffers.

    offset 0   magic b"FMQ" (3 bytes), format version (1 byte)
    offset 4   header length, uint32 little-endian
    offset 8   XXH3-64 of everything from offset 16 to the end, uint64 little-endian
    offset 16  msgpack header (a map, schema below)
    ...        zero padding to a multiple of ALIGN
    body       each tensor's bytes at a multiple of ALIGN from the body start, little-endian, C order

Header keys: ``kind`` (str), ``fed`` (str), ``round`` (int), ``sender`` (str), ``id`` (16 bytes),
``ts`` (float, sender's wall clock), ``meta`` (map of msgpack primitives), ``tensors`` (list of
``[name, dtype, shape, offset, nbytes]``), ``body`` (body length in bytes).

The checksum catches corruption and truncation (a broker or client bug, a chunk put in the wrong
place), not tampering. It is XXH3-64 rather than CRC-32: over a 45 MB model zlib's CRC-32 took
longer than copying the bytes (fedmq bench codec), XXH3 about a third of the copy. Format 1 (CRC-32)
is refused with a ``wrong-version`` error naming both.

Decoding never copies tensor data: arrays are read-only `numpy` views on the received buffer. Nothing
here can execute code from the input (no pickle, no msgpack ext types).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import xxhash

from fedmq.broker.errors import CodecError
from fedmq.broker.message import MESSAGE_ID_BYTES, Kind, Message

MAGIC = b"FMQ"
FORMAT_VERSION = 2
ALIGN = 64
PREFIX = struct.Struct("<3sBIQ")
PREFIX_BYTES = PREFIX.size  # 16

#: numpy has no bfloat16: fedmq carries it as uint16 storage tagged with this dtype.
#: ``np.frombuffer(..., dtype=BFLOAT16)`` arrays keep the tag through views and copies.
BFLOAT16 = np.dtype("<u2", metadata={"fedmq_dtype": "bfloat16"})

#: wire dtype name -> little-endian storage dtype
WIRE_DTYPES: dict[str, np.dtype[Any]] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": BFLOAT16,
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_NAME_OF = {(dt.kind, dt.itemsize): name for name, dt in WIRE_DTYPES.items() if name != "bfloat16"}

_HEADER_KEYS = frozenset({"kind", "fed", "round", "sender", "id", "ts", "meta", "tensors", "body"})
_MAX_NAME = 256
_MAX_DIMS = 16
_MAX_ELEMENTS = 2**48
"""A tensor's elements, counting only its non-zero dimensions: numpy refuses a shape whose product
does not fit its index type even when another dimension is 0 (``[0, 2**63]``), with a ValueError
that is not the codec's. 2**48 is far above any frame the bus carries."""
MAX_META_DEPTH = 32
"""How deep meta's lists and maps may nest. Daemons walk meta recursively (the event log's JSON, a
payload's copy); 600 nested lists from one foreign client made a RecursionError there (issue 31)."""
_KINDS = {k.value: k for k in Kind}


_HASH_BLOCK = 256 * 1024
"""Large tensors are copied and hashed in blocks this size, so the hash reads what the copy just
wrote from the CPU's cache instead of a second pass over memory."""


def checksum(frame: bytes | bytearray | memoryview) -> int:
    """XXH3-64 of a frame's bytes after the prefix: what the prefix's checksum field holds."""
    return xxhash.xxh3_64_intdigest(memoryview(frame)[PREFIX_BYTES:])


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def wire_dtype(dtype: np.dtype[Any]) -> str:
    """The wire name of a numpy dtype; ``TypeError`` names the supported ones otherwise."""
    meta = dtype.metadata
    if meta and meta.get("fedmq_dtype") == "bfloat16":
        return "bfloat16"
    name = _NAME_OF.get((dtype.kind, dtype.itemsize))
    if name is None:
        raise TypeError(f"dtype {dtype} cannot travel on the bus; supported: {', '.join(WIRE_DTYPES)}")
    return name


def _layout(tensors: Mapping[str, np.ndarray]) -> tuple[list[list[Any]], int]:
    specs: list[list[Any]] = []
    end = 0
    for name, arr in tensors.items():
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME:
            raise CodecError("bad-tensor", f"tensor names are non-empty strings of at most {_MAX_NAME} chars")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"tensor {name!r} is {type(arr).__name__}; the bus carries numpy arrays")
        nbytes = int(arr.nbytes)
        offset = align_up(end) if nbytes else end
        specs.append([name, wire_dtype(arr.dtype), list(arr.shape), offset, nbytes])
        end = offset + nbytes
    return specs, end


def encoded_size(message: Message) -> int:
    """The frame length `encode` will produce, without encoding the tensors."""
    specs, body_len = _layout(message.tensors)
    return align_up(PREFIX_BYTES + len(_pack_header(message, specs, body_len))) + body_len


def _pack_header(message: Message, specs: list[list[Any]], body: int) -> bytes:
    if len(message.message_id) != MESSAGE_ID_BYTES:
        raise CodecError("bad-header", f"message id must be {MESSAGE_ID_BYTES} bytes")
    try:
        return msgpack.packb(
            {
                "kind": str(Kind(message.kind)),
                "fed": message.federation,
                "round": int(message.round),
                "sender": message.sender,
                "id": bytes(message.message_id),
                "ts": float(message.sent_at),
                "meta": dict(message.meta),
                "tensors": specs,
                "body": body,
            },
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError("bad-header", f"meta is not msgpack-serialisable: {exc}") from exc


def encode(message: Message, out: bytearray | None = None) -> bytearray:
    """Encode into `out` (resized and reused when given) or a new buffer; returns the frame.

    Non-contiguous and big-endian inputs are copied straight into place, with no temporary copy.
    """
    specs, body_len = _layout(message.tensors)
    header = _pack_header(message, specs, body_len)
    body_start = align_up(PREFIX_BYTES + len(header))
    total = body_start + body_len
    if out is None:
        buf = bytearray(total)
    else:
        buf = out
        if len(buf) != total:
            buf[total:] = b""
            if len(buf) < total:
                buf.extend(bytes(total - len(buf)))
        buf[PREFIX_BYTES + len(header) : body_start] = bytes(body_start - PREFIX_BYTES - len(header))
    buf[PREFIX_BYTES : PREFIX_BYTES + len(header)] = header
    view = memoryview(buf)
    digest = xxhash.xxh3_64()  # fed as the bytes are written, while they are still in cache
    hashed = PREFIX_BYTES
    prev_end = body_start
    for (_name, dtype_name, shape, offset, nbytes), arr in zip(specs, message.tensors.values(), strict=True):
        start = body_start + offset
        if out is not None and start > prev_end:
            buf[prev_end:start] = bytes(start - prev_end)  # padding of a reused buffer must be zero again
        prev_end = start + nbytes
        if nbytes == 0:
            continue
        dst = np.frombuffer(buf, dtype=WIRE_DTYPES[dtype_name], count=nbytes // arr.itemsize, offset=start)
        if arr.flags.c_contiguous and arr.dtype.isnative and nbytes > _HASH_BLOCK:
            digest.update(view[hashed:start])
            src, step = arr.reshape(-1), _HASH_BLOCK // arr.itemsize
            for i in range(0, src.size, step):
                dst[i : i + step] = src[i : i + step]
                digest.update(view[start + i * arr.itemsize : start + min(i + step, src.size) * arr.itemsize])
        else:
            np.copyto(dst.reshape(shape), arr, casting="no" if arr.dtype.isnative else "equiv")
            digest.update(view[hashed:prev_end])
        hashed = prev_end
    digest.update(view[hashed:])
    view.release()
    PREFIX.pack_into(buf, 0, MAGIC, FORMAT_VERSION, len(header), digest.intdigest())
    return buf


def with_bytes_replaced(frame: bytes | bytearray, old: bytes, new: bytes) -> bytearray:
    """A copy of `frame` whose header holds the byte string `new` where it held `old` (of the same
    length, found exactly once), its checksum redone: one encoding made for many receivers that
    differ in one id (a round's tasks, each with its node's own task id), without encoding the
    tensors again. ValueError if `old` is not in the header exactly once."""
    if len(old) != len(new):
        raise ValueError(f"replacing {len(old)} bytes with {len(new)}")
    header_len = PREFIX.unpack_from(frame, 0)[2]
    header = bytes(memoryview(frame)[PREFIX_BYTES : PREFIX_BYTES + header_len])
    packed = msgpack.packb(old, use_bin_type=True)
    at = header.find(packed)
    if at < 0 or header.find(packed, at + 1) >= 0:
        raise ValueError("the bytes to replace are not in the frame's header exactly once")
    out = bytearray(frame)
    start = PREFIX_BYTES + at + len(packed) - len(old)
    out[start : start + len(new)] = new
    PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, header_len, checksum(out))
    return out


def decode(data: bytes | bytearray | memoryview, *, verify: bool = True) -> Message:
    """Decode and validate a frame. Raises `CodecError` with a `reason` for every malformed input,
    and nothing else: a frame is the one input any client can send to every daemon.

    `verify` false skips the checksum (one pass over every byte) and nothing else: for a frame whose
    bytes were verified already, such as one reassembled from checksummed chunks."""
    try:
        return _decode(data, verify=verify)
    except CodecError:
        raise
    except (ValueError, TypeError, OverflowError, RecursionError, KeyError, IndexError) as exc:
        # a check missed above: still the protocol's error, so no caller dies of it (the fuzz tests
        # in tests/broker/test_fuzz.py look for inputs that get here)
        raise CodecError("malformed", f"{type(exc).__name__}: {exc}") from exc


def _decode(data: bytes | bytearray | memoryview, *, verify: bool) -> Message:
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    size = len(view)
    if size < PREFIX_BYTES:
        raise CodecError("truncated", f"{size} bytes is shorter than the {PREFIX_BYTES}-byte prefix")
    magic, version, header_len, expected = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError("bad-magic", "not a fedmq frame")
    if version != FORMAT_VERSION:
        raise CodecError(
            "wrong-version", f"format version {version}, this build reads {FORMAT_VERSION}: upgrade the older side"
        )
    if PREFIX_BYTES + header_len > size:
        raise CodecError("truncated", f"header of {header_len} bytes does not fit in {size}")
    if verify and checksum(view) != expected:
        raise CodecError("checksum", "XXH3-64 mismatch: the frame was corrupted or truncated")
    try:
        header = msgpack.unpackb(
            view[PREFIX_BYTES : PREFIX_BYTES + header_len],
            raw=False,
            strict_map_key=True,
            use_list=True,
            ext_hook=_no_ext,
        )
    except CodecError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise CodecError("bad-header", f"header is not valid msgpack: {exc}") from exc
    fields = _check_header(header)
    body_start = align_up(PREFIX_BYTES + header_len)
    body_len = fields["body"]
    if body_start + body_len != size:
        raise CodecError("truncated", f"frame is {size} bytes, header announces {body_start + body_len}")
    tensors = _tensor_views(view, fields["tensors"], body_start, body_len)
    return Message(
        kind=_KINDS[fields["kind"]],
        federation=fields["fed"],
        round=fields["round"],
        sender=fields["sender"],
        meta=fields["meta"],
        tensors=tensors,
        message_id=fields["id"],
        sent_at=fields["ts"],
    )


def _no_ext(code: int, data: bytes) -> Any:
    raise CodecError("bad-header", f"msgpack extension type {code} is not allowed")


def _check_header(header: Any) -> dict[str, Any]:
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        # repr, not the keys: msgpack gives str and bytes keys, which do not sort together (issue 31)
        keys = sorted(map(repr, header)) if isinstance(header, dict) else type(header).__name__
        raise CodecError("bad-header", f"header keys {keys} != {sorted(_HEADER_KEYS)}")
    checks: list[tuple[str, type | tuple[type, ...]]] = [
        ("kind", str),
        ("fed", str),
        ("round", int),
        ("sender", str),
        ("id", bytes),
        ("ts", (float, int)),
        ("meta", dict),
        ("tensors", list),
        ("body", int),
    ]
    for key, typ in checks:
        value = header[key]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            raise CodecError("bad-header", f"header field {key!r} has type {type(value).__name__}")
    if header["kind"] not in _KINDS:
        raise CodecError("unknown-kind", f"message kind {header['kind']!r}")
    if len(header["id"]) != MESSAGE_ID_BYTES:
        raise CodecError("bad-header", "message id must be 16 bytes")
    if header["body"] < 0 or header["round"] < -1:
        raise CodecError("bad-header", "negative body length or round")
    if not math.isfinite(header["ts"]):
        raise CodecError("bad-header", "timestamp is not finite")
    _check_meta(header["meta"])
    return header


def _check_meta(meta: dict[Any, Any]) -> None:
    """Meta nests at most `MAX_META_DEPTH` deep and its maps' keys are strings (what JSON, the event
    log and every reader of meta expect). Walked with a stack, not recursion, so that the check
    itself cannot overflow."""
    stack: list[tuple[Any, int]] = [(meta, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_META_DEPTH:
            raise CodecError("bad-header", f"meta nests deeper than {MAX_META_DEPTH} levels")
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise CodecError("bad-header", "meta map keys must be strings")
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        else:
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))


def _tensor_views(data: memoryview, specs: list[Any], body_start: int, body_len: int) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    prev_end = 0
    for spec in specs:
        if not (isinstance(spec, list) and len(spec) == 5):
            raise CodecError("bad-tensor", "a tensor spec is [name, dtype, shape, offset, nbytes]")
        name, dtype_name, shape, offset, nbytes = spec
        if not isinstance(name, str) or not name or len(name) > _MAX_NAME or name in tensors:
            raise CodecError("bad-tensor", f"tensor name {name!r} is empty, too long or repeated")
        dtype = WIRE_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise CodecError("bad-tensor", f"tensor {name!r} has unknown dtype {dtype_name!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > _MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise CodecError("bad-tensor", f"tensor {name!r} has an invalid shape {shape!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes)):
            raise CodecError("bad-tensor", f"tensor {name!r} offset and size must be integers")
        if math.prod(d for d in shape if d) > _MAX_ELEMENTS:
            raise CodecError("bad-tensor", f"tensor {name!r} has an impossible shape {shape!r}")
        count = math.prod(shape)
        if nbytes != count * dtype.itemsize:
            raise CodecError("bad-tensor", f"tensor {name!r}: {nbytes} bytes for shape {shape} {dtype_name}")
        if offset < prev_end or (nbytes and offset % ALIGN) or offset + nbytes > body_len:
            raise CodecError("bad-tensor", f"tensor {name!r} at {offset} is misaligned, overlaps or overruns")
        prev_end = offset + nbytes
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=body_start + offset)
        tensors[name] = arr.reshape(shape)
    return tensors
