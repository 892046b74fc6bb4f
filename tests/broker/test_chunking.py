"""Chunk reassembly: in any order, duplicated, incomplete (abandoned), over the memory bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fedmq.broker.chunking import Reassembler, split
from fedmq.broker.codec import decode, encode
from fedmq.broker.errors import CodecError
from fedmq.broker.message import Kind, Message


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def frame_of(n_floats: int = 10_000, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32)
    return bytes(encode(Message(kind=Kind.MODEL, federation="f", round=1, sender="c", tensors={"w": data})))


def chunks_of(frame: bytes, size: int = 4096, sender: str = "c") -> list[Message]:
    # round-trip each chunk through the codec, as the bus does
    return [decode(encode(c)) for c in split(frame, chunk_bytes=size, federation="f", sender=sender, round=1)]


def test_reassembly_in_order_gives_the_original_frame() -> None:
    """Chunks in order rebuild the frame byte for byte, and only the last chunk completes it."""
    frame = frame_of()
    r = Reassembler(max_bytes=10**7, timeout_s=10)
    results = [r.add(c) for c in chunks_of(frame)]
    assert all(x is None for x in results[:-1])
    assert bytes(results[-1]) == frame
    assert len(r) == 0 and r.in_flight_bytes == 0


@pytest.mark.parametrize("order", ["reversed", "shuffled"])
def test_reassembly_any_order_gives_the_original_frame(order: str) -> None:
    """Brokers may reorder concurrently published chunks."""
    frame = frame_of()
    chunks = chunks_of(frame)
    if order == "reversed":
        chunks.reverse()
    else:
        np.random.default_rng(1).shuffle(chunks)  # type: ignore[arg-type]
    r = Reassembler(max_bytes=10**7, timeout_s=10)
    done = [x for x in (r.add(c) for c in chunks) if x is not None]
    assert len(done) == 1 and bytes(done[0]) == frame


def test_reassembly_duplicates_are_ignored_before_and_after_completion() -> None:
    """A redelivered chunk neither corrupts the transfer nor restarts it once complete."""
    frame = frame_of()
    chunks = chunks_of(frame)
    r = Reassembler(max_bytes=10**7, timeout_s=10)
    assert r.add(chunks[0]) is None and r.add(chunks[0]) is None
    out = [r.add(c) for c in chunks[1:]]
    assert bytes(out[-1]) == frame
    assert r.add(chunks[3]) is None and len(r) == 0
    assert r.duplicates == 2


def test_reassembly_incomplete_transfer_is_abandoned_after_timeout() -> None:
    """A missing chunk: the transfer is dropped at its timeout, its memory freed and reported."""
    clock = Clock()
    abandoned: list[str] = []
    r = Reassembler(max_bytes=10**7, timeout_s=5, clock=clock, on_abandon=lambda s, why: abandoned.append(why))
    chunks = chunks_of(frame_of())
    for c in chunks[:-1]:
        r.add(c)
    assert r.in_flight_bytes > 0 and r.next_deadline() == 5
    clock.now = 5.1
    assert r.expire() == 1
    assert r.in_flight_bytes == 0 and len(r) == 0
    assert "abandoned" in abandoned[0] and f"{len(chunks) - 1} of {len(chunks)}" in abandoned[0]


def test_reassembly_memory_bound_refuses_new_transfers() -> None:
    """Transfers beyond the bound are refused with 'memory-bound'; finishing one frees room."""
    frame = frame_of(10_000)
    r = Reassembler(max_bytes=int(len(frame) * 1.5), timeout_s=10)
    first, second = chunks_of(frame), chunks_of(frame_of(10_000, seed=2))
    r.add(first[0])
    with pytest.raises(CodecError) as info:
        r.add(second[0])
    assert info.value.reason == "memory-bound"
    for c in first[1:]:
        r.add(c)
    assert r.add(second[0]) is None


def test_reassembly_rejects_oversized_and_inconsistent_chunks() -> None:
    """A transfer announcing more than the per-transfer limit, or chunks that disagree, are refused."""
    chunks = chunks_of(frame_of())
    with pytest.raises(CodecError, match="oversized"):
        Reassembler(max_bytes=10**9, max_transfer_bytes=100, timeout_s=1).add(chunks[0])
    r = Reassembler(max_bytes=10**9, timeout_s=1)
    r.add(chunks[0])
    liar = dataclasses.replace(chunks[1], meta={**chunks[1].meta, "total": chunks[1].meta["total"] + 1})
    with pytest.raises(CodecError, match="bad-chunk"):
        r.add(liar)
    broken = dataclasses.replace(chunks[1], meta={**chunks[1].meta, "index": 10**6})
    with pytest.raises(CodecError, match="bad-chunk"):
        r.add(broken)
    with pytest.raises(CodecError, match="bad-chunk"):
        r.add(dataclasses.replace(chunks[1], meta={"xfer": b"short"}))


def test_reassembly_keys_transfers_by_sender() -> None:
    """Two senders reusing a transfer id cannot mix their chunks."""
    frame_a, frame_b = frame_of(seed=3), frame_of(seed=4)
    a = chunks_of(frame_a, sender="a")
    b = [dataclasses.replace(c, meta={**c.meta, "xfer": a[0].meta["xfer"]}) for c in chunks_of(frame_b, sender="b")]
    r = Reassembler(max_bytes=10**8, timeout_s=10)
    done = [x for pair in zip(a, b, strict=True) for x in map(r.add, pair) if x is not None]
    assert sorted(map(bytes, done)) == sorted([frame_a, frame_b])


def test_reassembly_refuses_chunks_that_overlap_and_leave_a_gap() -> None:
    """Sizes that add up to the frame are not enough: two chunks at the same offset leave a hole, and
    the frame is then refused instead of handed on unverified (its bytes are not checked a second time)."""
    frame = frame_of()
    chunks = chunks_of(frame)
    second = chunks[1]
    moved = dataclasses.replace(second, meta={**second.meta, "offset": chunks[0].meta["offset"]})
    r = Reassembler(max_bytes=10**7, timeout_s=10)
    with pytest.raises(CodecError, match="do not tile") as info:
        for chunk in [chunks[0], moved, *chunks[2:]]:
            r.add(chunk)
    assert info.value.reason == "bad-chunk" and len(r) == 0 and r.in_flight_bytes == 0


def _reassemble(r: Reassembler, frame: bytes) -> memoryview:
    out = [r.add(c) for c in chunks_of(frame)][-1]
    assert out is not None
    return out


def test_a_completed_frames_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    """A live view (here a decoded tensor) keeps its frame's buffer from being overwritten; once it
    is gone, the next transfer of the same size lands in the same memory."""
    r = Reassembler(max_bytes=10**7, timeout_s=10)
    first, second, third = frame_of(seed=1), frame_of(seed=2), frame_of(seed=3)
    weights = decode(_reassemble(r, first)).tensors["w"]  # the memoryview is dropped; the tensor stays
    kept = weights.copy()
    got = _reassemble(r, second)
    assert bytes(got) == second and r.reused_buffers == 0
    assert np.array_equal(weights, kept), "a frame still in use was overwritten"
    del weights, got
    spare = {a.ctypes.data for a in r._spare}
    again = _reassemble(r, third)
    assert bytes(again) == third and r.reused_buffers == 1
    assert np.frombuffer(again, np.uint8).ctypes.data in spare
    del again
    smaller = frame_of(seed=4, n_floats=5_000)
    assert bytes(_reassemble(r, smaller)) == smaller
    assert r.reused_buffers == 1, "a buffer of another size was reused"


def test_no_spare_buffers_allocates_every_time() -> None:
    r = Reassembler(max_bytes=10**7, timeout_s=10, spare_buffers=0)
    for seed in range(3):
        frame = frame_of(seed=seed)
        assert bytes(_reassemble(r, frame)) == frame
    assert r.reused_buffers == 0 and r._spare == []


def test_reassemblers_of_one_process_share_its_budget() -> None:
    """Issue 31: the bound was per connection, so a host of many nodes held many times it. Two
    reassemblers (two nodes of one host) each under their own bound are refused together past the
    shared budget; a completed transfer and an abandoned one give their bytes back."""
    from fedmq.broker.chunking import ReassemblyBudget

    clock = Clock()
    frame_a, frame_b = frame_of(10_000), frame_of(10_000, seed=2)
    budget = ReassemblyBudget(int(len(frame_a) * 1.5))
    node_1 = Reassembler(max_bytes=10 * len(frame_a), timeout_s=10, clock=clock, budget=budget)
    node_2 = Reassembler(max_bytes=10 * len(frame_a), timeout_s=10, clock=clock, budget=budget)
    a, b = chunks_of(frame_a), chunks_of(frame_b)
    node_1.add(a[0])
    with pytest.raises(CodecError, match="process's reassembly budget") as info:
        node_2.add(b[0])
    assert info.value.reason == "memory-bound" and len(node_2) == 0
    for c in a[1:]:
        node_1.add(c)
    assert budget.in_flight == 0
    assert node_2.add(b[0]) is None and budget.in_flight == len(frame_b)
    clock.now = 11
    assert node_2.expire() == 1 and budget.in_flight == 0
    node_1.add(b[0])
    node_1.clear()  # its client closed: the shared budget outlives it
    assert budget.in_flight == 0 and len(node_1) == 0


def test_bus_clients_share_the_process_budget() -> None:
    """Every BusClient of a process reserves from one budget, whose bound is the largest configured."""
    from fedmq.broker import BusClient, BusConfig
    from fedmq.broker.chunking import process_budget

    one = BusClient(BusConfig.from_url("mqtt://127.0.0.1:1"), client_id="a", federation="f")
    two = BusClient(BusConfig.from_url("mqtt://127.0.0.1:1", max_reassembly_bytes=2**20), client_id="b", federation="f")
    assert one._reassembler._budget is two._reassembler._budget is process_budget(1)
    assert process_budget(1).limit >= one.config.max_reassembly_bytes


def test_one_sender_holds_at_most_two_of_the_largest_transfers_in_flight() -> None:
    """Issue 31, item 7: headers declaring large totals under one sender id took the whole bound
    from every other sender. A sender now holds at most twice `max_transfer_bytes`; the others are
    unaffected, and a finished transfer gives its share back."""
    frame = frame_of(10_000)
    r = Reassembler(max_bytes=100 * len(frame), timeout_s=10, max_transfer_bytes=len(frame))
    a = [chunks_of(frame_of(10_000, seed=s), sender="a") for s in range(3)]
    r.add(a[0][0])
    r.add(a[1][0])
    with pytest.raises(CodecError, match=r"^memory-bound: a has \d+ bytes in flight") as info:
        r.add(a[2][0])
    assert info.value.reason == "memory-bound"
    assert r.add(chunks_of(frame, sender="b")[0]) is None  # another sender still gets room
    for c in a[0][1:]:
        r.add(c)
    assert r.add(a[2][0]) is None  # a's first transfer finished: its share is back
