"""Fuzzing the two parsers every daemon runs on a foreign client's bytes: `decode` and chunk
reassembly. Whatever the input, the only exception is `CodecError`, and never its catch-all reason
``malformed`` (which `decode` keeps as a last fence, so that a check missed here is still no crash).

The examples are bounded so that the suite stays fast. A longer run, for instance before a release:

    FEDMQ_FUZZ_EXAMPLES=200000 pytest tests/broker/test_fuzz.py -q

(hypothesis prints the failing input; each test runs FEDMQ_FUZZ_EXAMPLES examples, from a random
seed, instead of the suite's fixed few hundred to few thousand).
"""

from __future__ import annotations

import os
import struct
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.broker.chunking import XFER_ID_BYTES, Reassembler
from fedmq.broker.codec import PREFIX_BYTES, WIRE_DTYPES, checksum, decode, encode
from fedmq.broker.errors import CodecError
from fedmq.broker.message import Kind, Message
from tests.helpers import frame_with_header as _frame_with

LONG_RUN = os.environ.get("FEDMQ_FUZZ_EXAMPLES")


def fuzz(examples: int) -> settings:
    """`examples` in the suite (its cost kept to seconds), FEDMQ_FUZZ_EXAMPLES each in a long run."""
    return settings(
        max_examples=int(LONG_RUN) if LONG_RUN else examples,
        deadline=timedelta(seconds=2),  # per example: a hang or a huge allocation fails, a loaded machine does not
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=not LONG_RUN,  # the suite's run is reproducible; a long run explores
        database=None,
    )


_scalar = (
    st.none()
    | st.booleans()
    | st.integers(-(2**64), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
_value = st.recursive(
    _scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=4)
    ),
    max_leaves=40,
)
_dim = st.integers(0, 8) | st.integers(-(2**63), 2**64 - 1)
_spec = st.lists(
    st.one_of(
        st.text(max_size=6),
        st.sampled_from([*WIRE_DTYPES, "complex64"]),
        st.lists(_dim, max_size=20),
        st.integers(-(2**63), 2**64 - 1),
        _value,
    ),
    min_size=0,
    max_size=6,
)
_header_field = {
    "kind": st.sampled_from([str(k) for k in Kind]) | _value,
    "fed": st.just("fed") | _value,
    "round": st.integers(-3, 2**64 - 1) | _value,
    "sender": st.just("node-1") | _value,
    "id": st.binary(min_size=16, max_size=16) | _value,
    "ts": st.floats() | _value,
    "meta": st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), _value, max_size=4) | _value,
    "tensors": st.lists(_spec, max_size=4) | _value,
    "body": st.integers(0, 512) | _value,
}


def _decode_only_codec_error(data: bytes, *, verify: bool = True) -> None:
    try:
        decode(data, verify=verify)
    except CodecError as exc:
        assert exc.reason != "malformed", f"a check is missing: {exc}"


@fuzz(3000)
@given(data=st.binary(max_size=600), verify=st.booleans())
def test_fuzz_decode_random_bytes(data: bytes, verify: bool) -> None:
    _decode_only_codec_error(data, verify=verify)
    _decode_only_codec_error(b"FMQ\x02" + data, verify=verify)


@fuzz(300)
@given(
    fields=st.fixed_dictionaries(_header_field),
    extra=st.dictionaries(st.text(max_size=4) | st.binary(max_size=4) | st.integers(), _value, max_size=2),
    drop=st.sets(st.sampled_from(sorted(_header_field)), max_size=2),
    body=st.binary(max_size=256),
    pad=st.integers(0, 200),
)
def test_fuzz_decode_structured_headers(
    fields: dict[str, Any], extra: dict[Any, Any], drop: set[str], body: bytes, pad: int
) -> None:
    """Headers near the schema (each field valid or any msgpack value, keys dropped or added), with a
    valid checksum: the checks past the prefix all run."""
    header: dict[Any, Any] = {k: v for k, v in fields.items() if k not in drop}
    if not drop:
        header |= extra
    if isinstance(header.get("body"), int) and header["body"] >= 0:
        body = (body + bytes(pad))[: header["body"]].ljust(header["body"], b"\0")
    try:
        frame = _frame_with(header, body)
    except (OverflowError, ValueError, TypeError):
        return  # msgpack cannot pack it: no sender can either
    _decode_only_codec_error(frame)
    _decode_only_codec_error(frame, verify=False)


_good = bytes(
    encode(
        Message(
            kind=Kind.UPDATE,
            federation="fed",
            round=3,
            sender="node-1",
            meta={"task": b"t" * 16, "n": [1, {"a": 2}]},
            tensors={"w": np.arange(64, dtype=np.float32), "b": np.zeros((0, 3), np.int64)},
        )
    )
)


@fuzz(2000)
@given(
    edits=st.lists(st.tuples(st.integers(0, len(_good) - 1), st.integers(0, 255)), max_size=8),
    cut=st.integers(0, len(_good)),
)
def test_fuzz_decode_mutated_frame_with_checksum_fixed(edits: list[tuple[int, int]], cut: int) -> None:
    """Bytes of a real frame overwritten and the checksum made right again, as a hostile sender would."""
    frame = bytearray(_good[:cut])
    for at, value in edits:
        if at < len(frame):
            frame[at] = value
    if len(frame) >= PREFIX_BYTES:
        struct.pack_into("<Q", frame, 8, checksum(frame))
    _decode_only_codec_error(bytes(frame))


def _chunk(sender: str, meta: dict[str, Any], data: np.ndarray) -> bytes:
    return bytes(
        encode(Message(kind=Kind.CHUNK, federation="fed", round=0, sender=sender, meta=meta, tensors={"data": data}))
    )


_xfers = st.sampled_from([b"a" * XFER_ID_BYTES, b"b" * XFER_ID_BYTES, b"short"])
_small = st.integers(-2, 6) | st.integers(-(2**63), 2**64 - 1)
_chunk_meta = st.fixed_dictionaries(
    {
        "xfer": _xfers | _value,
        "index": _small | _value,
        "count": _small,
        "total": _small | st.integers(0, 64),
        "offset": _small | st.integers(0, 64),
    },
    optional={"extra": _value},
)


@fuzz(300)
@given(
    chunks=st.lists(
        st.tuples(
            st.sampled_from(["n1", "n2"]),
            _chunk_meta,
            st.sampled_from(["uint8", "float32", "uint8-2d"]),
            st.integers(0, 40),
        ),
        max_size=12,
    ),
    drop_keys=st.sets(st.sampled_from(["xfer", "index", "count", "total", "offset"]), max_size=1),
)
def test_fuzz_chunk_reassembly(chunks: list[tuple[str, dict[str, Any], str, int]], drop_keys: set[str]) -> None:
    """Chunks with any meta and data, decoded and placed as the bus client does: only CodecError, and
    the bound on bytes in flight holds throughout."""
    reassembler = Reassembler(max_bytes=256, max_transfer_bytes=128, timeout_s=60)
    for sender, meta, kind, size in chunks:
        meta = {k: v for k, v in meta.items() if k not in drop_keys}
        if kind == "uint8":
            data = np.arange(size, dtype=np.uint8)
        elif kind == "float32":
            data = np.zeros(size, np.float32)
        else:
            data = np.zeros((size, 1), np.uint8)
        try:
            frame = _chunk(sender, meta, data)
        except (OverflowError, ValueError, TypeError, CodecError):
            continue
        try:
            message = decode(frame)
            out = reassembler.add(message)
        except CodecError as exc:
            assert exc.reason != "malformed", f"a check is missing: {exc}"
            continue
        finally:
            assert 0 <= reassembler.in_flight_bytes <= 256
        if out is not None:
            _decode_only_codec_error(bytes(out), verify=False)


@pytest.mark.parametrize("depth", [100, 600])
def test_deeply_nested_headers_are_the_codecs_error(depth: int) -> None:
    """msgpack's own limit or the meta depth bound: either way a CodecError."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    header = {"kind": "update", "fed": "fed", "round": 0, "sender": "n", "id": b"\x01" * 16, "ts": 1.0,
              "meta": {"x": value}, "tensors": [], "body": 0}  # fmt: skip
    try:
        frame = _frame_with(header, b"")
    except ValueError:
        pytest.skip("msgpack refuses to pack it")
    with pytest.raises(CodecError):
        decode(frame)
