"""The wire codec: exact round trips for every dtype and shape, zero-copy decoding, and a
CodecError with a reason for every kind of malformed frame."""

from __future__ import annotations

import contextlib
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedmq.broker.codec import (
    ALIGN,
    BFLOAT16,
    PREFIX,
    checksum,
    decode,
    encode,
    encoded_size,
    with_bytes_replaced,
)
from fedmq.broker.errors import CodecError
from fedmq.broker.message import Kind, Message
from tests.helpers import frame_with_header as _with_header

DTYPES = ["float32", "float16", "int64", "int32", "uint8", "bool", "float64", "int16", "int8"]


def msg(tensors: dict[str, np.ndarray] | None = None, **meta: object) -> Message:
    return Message(kind=Kind.UPDATE, federation="fed", round=3, sender="node-1", meta=meta, tensors=tensors or {})


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert a.tobytes() == np.ascontiguousarray(b).tobytes()


@settings(max_examples=150, deadline=None)
@given(
    arrays=st.lists(
        st.sampled_from(DTYPES).flatmap(
            lambda dt: hnp.arrays(np.dtype(dt), hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
        ),
        max_size=5,
    )
)
def test_codec_round_trip_any_dtype_and_shape_is_exact(arrays: list[np.ndarray]) -> None:
    """Every supported dtype and shape (0-d and empty included) comes back bit for bit."""
    tensors = {f"t{i}": a for i, a in enumerate(arrays)}
    out = decode(bytes(encode(msg(tensors))))
    assert list(out.tensors) == list(tensors)
    for name, array in tensors.items():
        assert_same(out.tensors[name], array)


def test_codec_bfloat16_round_trip_keeps_tag() -> None:
    """bfloat16 travels as tagged uint16 storage and decodes with the tag."""
    raw = np.arange(12, dtype=np.uint16).view(BFLOAT16).reshape(3, 4)
    out = decode(encode(msg({"w": raw})))
    assert out.tensors["w"].dtype.metadata == {"fedmq_dtype": "bfloat16"}
    assert_same(out.tensors["w"], raw)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(24, dtype=np.float32).reshape(4, 6).T,
        np.arange(40, dtype=np.int64).reshape(5, 8)[::2, 1::3],
        np.arange(10, dtype=">f4"),
        np.array(7.5, dtype=np.float16),
        np.zeros((0, 5), dtype=np.int32),
        np.array([True, False, True]),
    ],
    ids=["transposed", "strided", "big-endian", "0-d", "empty", "bool"],
)
def test_codec_awkward_inputs_round_trip(array: np.ndarray) -> None:
    """Non-contiguous, big-endian, 0-d and empty inputs are copied straight into place."""
    out = decode(encode(msg({"x": array, "after": np.ones(3, np.float32)})))
    assert np.array_equal(out.tensors["x"], array)
    assert out.tensors["x"].dtype == array.dtype.newbyteorder("<")
    assert np.array_equal(out.tensors["after"], np.ones(3, np.float32))


def test_codec_decode_gives_read_only_views_on_the_frame() -> None:
    """Decoding copies no tensor data: arrays share memory with the received buffer, aligned."""
    frame = bytearray(encode(msg({"a": np.ones(1000, np.float32), "b": np.arange(7, dtype=np.int64)})))
    out = decode(frame)
    whole = np.frombuffer(frame, dtype=np.uint8)
    for array in out.tensors.values():
        assert np.shares_memory(array, whole)
        offset = array.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
        assert offset % ALIGN == 0
    frozen = decode(bytes(frame)).tensors["a"]
    assert not frozen.flags.writeable


def test_codec_header_fields_round_trip() -> None:
    """Envelope fields and free metadata survive; the size is predicted without encoding."""
    m = Message(
        kind=Kind.TASK, federation="f-1", round=-1, sender="coordinator", meta={"a": [1, 2.5, "x"], "b": b"\x00"}
    )
    frame = encode(m)
    assert encoded_size(m) == len(frame)
    out = decode(frame)
    assert (out.kind, out.federation, out.round, out.sender) == (Kind.TASK, "f-1", -1, "coordinator")
    assert out.message_id == m.message_id and out.sent_at == m.sent_at
    assert out.meta == {"a": [1, 2.5, "x"], "b": b"\x00"}


def test_codec_encode_into_reused_buffer_matches_fresh_encoding() -> None:
    """A reused buffer, larger or smaller than needed, gives the same bytes as a fresh one."""
    big = msg({"a": np.random.default_rng(0).standard_normal(5000).astype(np.float32)})
    small = msg({"b": np.arange(3, dtype=np.int32)})
    buf = bytearray(b"\xff" * 100_000)
    for m in (big, small, big):
        assert bytes(encode(m, out=buf)) == bytes(encode(m))


def test_codec_rejects_non_serialisable_meta_and_unknown_dtype() -> None:
    """Encoding errors are raised to the caller with the offending field."""
    with pytest.raises(CodecError, match="bad-header"):
        encode(msg(x=object()))
    with pytest.raises(TypeError, match="cannot travel"):
        encode(msg({"c": np.zeros(2, np.complex64)}))


def _frame() -> bytearray:
    return encode(msg({"w": np.arange(64, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}, note="x"))


def _header(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "kind": "update", "fed": "fed", "round": 0, "sender": "n", "id": b"\x01" * 16, "ts": 1.0, "meta": {},
        "tensors": [], "body": 0,
    }  # fmt: skip
    base.update(changes)
    return base


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def _nested_maps(depth: int) -> dict[str, object]:
    value: dict[str, object] = {"leaf": 1}
    for _ in range(depth):
        value = {"x": value}
    return value


BAD_FRAMES = {
    "empty": (b"", "truncated"),
    "short": (b"FMQ\x02\x00", "truncated"),
    "bad-magic": (b"XYZ" + bytes(_frame()[3:]), "bad-magic"),
    "old-version-crc32": (b"FMQ\x01" + bytes(_frame()[4:]), "wrong-version"),
    "future-version": (b"FMQ\x03" + bytes(_frame()[4:]), "wrong-version"),
    "header-overrun": (bytes(_frame()[:4]) + struct.pack("<I", 10**9) + bytes(_frame()[8:]), "truncated"),
    "truncated-body": (bytes(_frame()[:-5]), "checksum"),
    "bit-flip": (bytes(_frame()[:-1]) + bytes([_frame()[-1] ^ 1]), "checksum"),
    "header-not-map": (_with_header([1, 2, 3]), "bad-header"),
    "header-missing-key": (_with_header({"kind": "update"}), "bad-header"),
    "header-wrong-type": (_with_header(_header(round="3")), "bad-header"),
    "bool-round": (_with_header(_header(round=True)), "bad-header"),
    "unknown-kind": (_with_header(_header(kind="launch-missiles")), "unknown-kind"),
    "short-id": (_with_header(_header(id=b"\x01")), "bad-header"),
    "nan-timestamp": (_with_header(_header(ts=float("nan"))), "bad-header"),
    "body-length-lie": (_with_header(_header(body=64)), "truncated"),
    "ext-type": (_with_header(_header(meta={"x": msgpack.ExtType(1, b"evil")})), "bad-header"),
    "unknown-dtype": (
        _with_header(_header(tensors=[["w", "complex64", [1], 0, 8]], body=8), b"\x00" * 8),
        "bad-tensor",
    ),
    "size-mismatch": (
        _with_header(_header(tensors=[["w", "float32", [3], 0, 8]], body=12), b"\x00" * 12),
        "bad-tensor",
    ),
    "negative-dim": (_with_header(_header(tensors=[["w", "float32", [-1], 0, 0]], body=0)), "bad-tensor"),
    "overrun": (_with_header(_header(tensors=[["w", "float32", [4], 0, 16]], body=8), b"\x00" * 8), "bad-tensor"),
    "misaligned": (_with_header(_header(tensors=[["w", "uint8", [4], 4, 4]], body=8), b"\x00" * 8), "bad-tensor"),
    "overlap": (
        _with_header(_header(tensors=[["a", "uint8", [64], 0, 64], ["b", "uint8", [4], 0, 4]], body=64), b"\x00" * 64),
        "bad-tensor",
    ),
    "repeated-name": (
        _with_header(_header(tensors=[["a", "uint8", [1], 0, 1], ["a", "uint8", [1], 64, 1]], body=65), b"\x00" * 65),
        "bad-tensor",
    ),
    "spec-not-list": (_with_header(_header(tensors=["w"], body=0)), "bad-tensor"),
    # issue 31: numpy's ValueError for a zero-size tensor whose other dimension no array can have
    "zero-size-huge-dim": (_with_header(_header(tensors=[["w", "float32", [0, 2**63], 0, 0]], body=0)), "bad-tensor"),
    "zero-size-huge-product": (
        _with_header(_header(tensors=[["w", "uint8", [0, 2**40, 2**40], 0, 0]], body=0)),
        "bad-tensor",
    ),
    # issue 31: a TypeError from sorting str and bytes keys while saying which keys were wrong
    "bytes-header-key": (_with_header({**_header(), b"kind": "update"}), "bad-header"),
    "bytes-meta-key": (_with_header(_header(meta={b"task": 1})), "bad-header"),
    # issue 31: 600 nested lists in meta became a RecursionError in the coordinator's event log
    "deep-meta": (_with_header(_header(meta={"x": _nested(600)})), "bad-header"),
    "deep-meta-maps": (_with_header(_header(meta=_nested_maps(40))), "bad-header"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_codec_malformed_frame_is_rejected_with_reason(name: str) -> None:
    """Every malformed input raises CodecError with the reason daemons count, nothing else."""
    data, reason = BAD_FRAMES[name]
    with pytest.raises(CodecError) as info:
        decode(data)
    assert info.value.reason == reason


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_codec_random_corruption_only_raises_codec_error(data: st.DataObject) -> None:
    """Truncating or overwriting any bytes of a frame never escapes as another exception."""
    frame = bytearray(_frame())
    cut = data.draw(st.integers(0, len(frame)))
    frame = frame[:cut]
    for _ in range(data.draw(st.integers(0, 4))):
        if frame:
            frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    verify = data.draw(st.booleans())
    with contextlib.suppress(CodecError):
        decode(bytes(frame), verify=verify)


def test_blockwise_hashing_gives_the_one_pass_checksum_for_every_layout() -> None:
    """Large tensors are copied and hashed in blocks; the prefix must still hold XXH3 of the whole
    frame, for contiguous, strided and big-endian tensors on either side of the block size, in a new
    buffer and in a reused one that was larger before."""
    from fedmq.broker.codec import _HASH_BLOCK

    rng = np.random.default_rng(5)
    big = rng.standard_normal(_HASH_BLOCK // 4 * 3 + 7).astype(np.float32)
    tensors = {
        "a/small": rng.standard_normal(10).astype(np.float32),
        "a/big": big,
        "a/exact": rng.standard_normal(_HASH_BLOCK // 8).astype(np.float64),
        "a/strided": rng.standard_normal((700, 300)).astype(np.float32)[:, ::2],
        "a/big_endian": rng.standard_normal(_HASH_BLOCK // 2).astype(">f4"),
        "a/empty": np.zeros(0, np.float32),
    }
    message = Message(kind=Kind.MODEL, federation="f", round=1, sender="c", tensors=tensors)
    reused = bytearray(b"\xff" * (3 * _HASH_BLOCK * 8))
    for frame in (encode(message), encode(message, reused)):
        assert PREFIX.unpack_from(frame, 0)[3] == checksum(frame)
        back = decode(frame)
        for name, arr in tensors.items():
            assert np.array_equal(back.tensors[name], arr), name


def test_codec_meta_nested_up_to_the_bound_round_trips() -> None:
    """Meta may nest as deep as `MAX_META_DEPTH` (lists and maps); one level more is refused."""
    from fedmq.broker.codec import MAX_META_DEPTH

    ok = msg(x=_nested(MAX_META_DEPTH - 1))
    assert decode(bytes(encode(ok))).meta == {"x": _nested(MAX_META_DEPTH - 1)}
    with pytest.raises(CodecError, match="nest"):
        decode(bytes(encode(msg(x=_nested(MAX_META_DEPTH)))))


def test_codec_zero_size_tensors_with_large_dimensions_still_decode() -> None:
    """A zero-size tensor whose other dimensions are large but possible is a valid tensor."""
    out = decode(bytes(encode(msg({"w": np.zeros((0, 100_000), np.float32)}))))
    assert out.tensors["w"].shape == (0, 100_000)


def test_with_bytes_replaced_gives_a_valid_frame_differing_in_that_id_only() -> None:
    """A round's task frame is encoded once and copied per node with its own task id (issue 31): the
    copy decodes (checksum redone) to the same message but for the id; the original is untouched."""
    old, new = bytes(range(16)), bytes(range(100, 116))
    frame = encode(msg({"w": np.arange(300, dtype=np.float32)}, task=old, other=b"x" * 16))
    copy = with_bytes_replaced(frame, old, new)
    a, b = decode(frame), decode(copy)
    assert a.meta["task"] == old and b.meta == {"task": new, "other": b"x" * 16}
    assert a.message_id == b.message_id and len(copy) == len(frame)
    assert_same(a.tensors["w"], b.tensors["w"])
    with pytest.raises(ValueError, match="exactly once"):
        with_bytes_replaced(frame, b"z" * 16, new)
    with pytest.raises(ValueError):
        with_bytes_replaced(frame, old, b"short")
