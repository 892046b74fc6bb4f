"""Split frames larger than the chunk size, and reassemble them into one preallocated buffer.

Each chunk is an ordinary frame of kind ``chunk`` (so it has its own CRC) whose single tensor
``data`` is a slice of the original frame. Its meta says where the slice goes:
``xfer`` (16-byte transfer id), ``index``, ``count``, ``total`` (frame length) and ``offset``.
Brokers and clients deliver chunks in any order, possibly twice; the reassembler copies each into
place once and hands back the whole frame when the last one lands, after checking that the chunks
cover it exactly (no gap, no overlap): each chunk's own checksum was verified on arrival, so the
frame needs no second pass over its bytes.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from fedmq.broker.errors import CodecError
from fedmq.broker.message import Kind, Message

logger = logging.getLogger(__name__)

XFER_ID_BYTES = 16


def split(frame: bytes | bytearray, *, chunk_bytes: int, federation: str, sender: str, round: int) -> Iterator[Message]:
    """Yield the chunk messages of `frame`, each carrying at most `chunk_bytes` of it (a view, not a copy)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    xfer = os.urandom(XFER_ID_BYTES)
    total = len(frame)
    count = max(1, math.ceil(total / chunk_bytes))
    whole = np.frombuffer(frame, dtype=np.uint8)
    for index in range(count):
        offset = index * chunk_bytes
        yield Message(
            kind=Kind.CHUNK,
            federation=federation,
            round=round,
            sender=sender,
            meta={"xfer": xfer, "index": index, "count": count, "total": total, "offset": offset},
            tensors={"data": whole[offset : offset + chunk_bytes]},
        )


class ReassemblyBudget:
    """Bytes held by the incomplete transfers of several reassemblers together: one bus client per
    node, a thousand nodes in one process, each with its own bound, multiplied the memory one host
    could be made to hold (issue 31: 200 MiB of chunks to one node raised its host by 260 MB, and the
    2 GiB bound was per node). `BusClient`s share `process_budget()`."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("a reassembly budget must be positive")
        self.limit = limit
        self.in_flight = 0

    def reserve(self, nbytes: int) -> bool:
        """Take `nbytes` if they fit (False, and nothing taken, if not)."""
        if self.in_flight + nbytes > self.limit:
            return False
        self.in_flight += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_flight = max(self.in_flight - nbytes, 0)


_PROCESS_BUDGET: ReassemblyBudget | None = None


def process_budget(limit: int) -> ReassemblyBudget:
    """The budget every bus client of this process shares. Its limit is the largest any of them was
    configured with (`BusConfig.max_reassembly_bytes`), so that no client is held below its own
    setting by another's; each client's own bound holds as well."""
    global _PROCESS_BUDGET
    if _PROCESS_BUDGET is None:
        _PROCESS_BUDGET = ReassemblyBudget(limit)
    else:
        _PROCESS_BUDGET.limit = max(_PROCESS_BUDGET.limit, limit)
    return _PROCESS_BUDGET


@dataclass(slots=True)
class _Transfer:
    sender: str
    total: int
    count: int
    buffer: np.ndarray
    """Not zero-filled: its pages are touched as the chunks land, not all at once at the first one."""
    received: set[int] = field(default_factory=set)
    spans: list[tuple[int, int]] = field(default_factory=list)
    received_bytes: int = 0
    started: float = 0.0

    def covered_exactly(self) -> bool:
        """The chunks' (offset, length) tile [0, total) with no gap and no overlap."""
        end = 0
        for offset, length in sorted(self.spans):
            if offset != end:
                return False
            end += length
        return end == self.total


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    xfer: bytes
    index: int
    count: int
    total: int
    offset: int

    @classmethod
    def of(cls, chunk: Message) -> ChunkMeta:
        meta = chunk.meta
        try:
            xfer, index, count, total, offset = (meta[k] for k in ("xfer", "index", "count", "total", "offset"))
        except (KeyError, TypeError) as exc:
            raise CodecError("bad-chunk", f"chunk meta lacks {exc}") from exc
        if not isinstance(xfer, bytes) or len(xfer) != XFER_ID_BYTES:
            raise CodecError("bad-chunk", "transfer id must be 16 bytes")
        ints = (index, count, total, offset)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise CodecError("bad-chunk", "chunk index, count, total and offset must be integers")
        if not (0 <= index < count and total >= 0 and 0 <= offset <= total):
            raise CodecError("bad-chunk", f"chunk {index}/{count} at {offset} of {total} is out of range")
        return cls(xfer, index, count, total, offset)


class Reassembler:
    """Collects chunks per (sender, transfer id) under a memory bound and a timeout.

    `add` returns the complete frame once every chunk has arrived; duplicates are ignored; a
    transfer that does not complete within `timeout_s` of its first chunk is abandoned, logged,
    and reported through `on_abandon`.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        timeout_s: float,
        max_transfer_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember_completed: int = 4096,
        on_abandon: Callable[[str, str], None] | None = None,
        spare_buffers: int = 2,
        budget: ReassemblyBudget | None = None,
    ) -> None:
        """`spare_buffers`: completed frames' buffers kept to receive the next transfer of the same
        size into, once nothing refers to them any more (a fresh 45 MB buffer costs a page fault per
        page: about a quarter of the receiver's time at 1 GB/s). 0 allocates every time.
        `budget`: a bound shared with other reassemblers (the process's), besides `max_bytes`."""
        if max_bytes <= 0 or timeout_s <= 0:
            raise ValueError("max_bytes and timeout_s must be positive")
        self.max_bytes = max_bytes
        self.max_transfer_bytes = max_transfer_bytes or max_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._transfers: dict[tuple[str, bytes], _Transfer] = {}
        self._completed: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._remember = remember_completed
        self._budget = budget
        self._on_abandon = on_abandon
        self.in_flight_bytes = 0
        self._per_sender: dict[str, int] = {}
        """Bytes of incomplete transfers by sender."""
        self.duplicates = 0
        self.reused_buffers = 0
        self._spare_limit = spare_buffers
        self._spare: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self._transfers)

    def add(self, chunk: Message) -> memoryview | None:
        """Place one chunk. Raises `CodecError` for chunks that are inconsistent or over the bound."""
        self.expire()
        meta = ChunkMeta.of(chunk)
        data = chunk.tensors.get("data")
        if data is None or data.dtype != np.uint8 or data.ndim != 1:
            raise CodecError("bad-chunk", "a chunk carries one uint8 vector named 'data'")
        key = (chunk.sender, meta.xfer)
        if key in self._completed:
            self.duplicates += 1
            return None
        transfer = self._transfers.get(key)
        if transfer is None:
            transfer = self._start(key, meta)
        elif transfer.total != meta.total or transfer.count != meta.count:
            raise CodecError("bad-chunk", "chunk disagrees with its transfer's total size or count")
        if meta.index in transfer.received:
            self.duplicates += 1
            return None
        if meta.offset + len(data) > transfer.total:
            raise CodecError("bad-chunk", "chunk overruns the announced frame length")
        transfer.buffer[meta.offset : meta.offset + len(data)] = data
        transfer.received.add(meta.index)
        transfer.spans.append((meta.offset, len(data)))
        transfer.received_bytes += len(data)
        if len(transfer.received) < transfer.count:
            return None
        del self._transfers[key]
        self._release(transfer.total, transfer.sender)
        self._completed[key] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        if transfer.received_bytes != transfer.total or not transfer.covered_exactly():
            raise CodecError(
                "bad-chunk", f"chunks of {transfer.received_bytes} bytes do not tile the {transfer.total}-byte frame"
            )
        self._keep_spare(transfer.buffer)
        return memoryview(transfer.buffer)  # type: ignore[arg-type]  # numpy arrays are buffers

    def _keep_spare(self, buffer: np.ndarray) -> None:
        if self._spare_limit > 0:
            self._spare.append(buffer)
            del self._spare[: -self._spare_limit]

    def _take_spare(self, total: int) -> np.ndarray | None:
        """A kept buffer of exactly `total` bytes that nothing else refers to: every view on a frame
        (a memoryview, a decoded tensor, a torch tensor made from one) holds a reference to it, so
        only the list's own reference (and the call's) means that the frame's data is dead."""
        for i in range(len(self._spare)):
            if self._spare[i].nbytes == total and sys.getrefcount(self._spare[i]) == 2:
                self.reused_buffers += 1
                return self._spare.pop(i)
        return None

    def _start(self, key: tuple[str, bytes], meta: ChunkMeta) -> _Transfer:
        if meta.total > self.max_transfer_bytes:
            raise CodecError("oversized", f"transfer of {meta.total} bytes exceeds {self.max_transfer_bytes}")
        held = self._per_sender.get(key[0], 0)
        if held + meta.total > 2 * self.max_transfer_bytes:
            # one sender, however many transfers it opens, holds at most two of the largest: forged
            # headers under one id cannot take the whole bound from every other sender (issue 31)
            raise CodecError(
                "memory-bound",
                f"{key[0]} has {held} bytes in flight; {meta.total} more would exceed its share of"
                f" {2 * self.max_transfer_bytes}",
            )
        if self.in_flight_bytes + meta.total > self.max_bytes:
            raise CodecError(
                "memory-bound",
                f"{meta.total} more bytes would exceed the reassembly bound of {self.max_bytes}"
                f" ({self.in_flight_bytes} in flight over {len(self._transfers)} transfers)",
            )
        if self._budget is not None and not self._budget.reserve(meta.total):
            raise CodecError(
                "memory-bound",
                f"{meta.total} more bytes would exceed the process's reassembly budget of {self._budget.limit}"
                f" ({self._budget.in_flight} in flight over all its connections)",
            )
        buffer = self._take_spare(meta.total)
        if buffer is None:
            buffer = np.empty(meta.total, dtype=np.uint8)
        transfer = _Transfer(key[0], meta.total, meta.count, buffer, started=self._clock())
        self._transfers[key] = transfer
        self.in_flight_bytes += meta.total
        self._per_sender[key[0]] = held + meta.total
        return transfer

    def clear(self) -> None:
        """Drop every incomplete transfer (its client is closing): the bytes go back to the shared
        budget, which outlives the client."""
        for transfer in self._transfers.values():
            self._release(transfer.total, transfer.sender)
        self._transfers.clear()

    def _release(self, nbytes: int, sender: str) -> None:
        self.in_flight_bytes -= nbytes
        left = self._per_sender.pop(sender, 0) - nbytes
        if left > 0:
            self._per_sender[sender] = left
        if self._budget is not None:
            self._budget.release(nbytes)

    def expire(self) -> int:
        """Abandon transfers older than the timeout; returns how many were dropped."""
        now = self._clock()
        stale = [k for k, t in self._transfers.items() if now - t.started > self.timeout_s]
        for key in stale:
            transfer = self._transfers.pop(key)
            self._release(transfer.total, transfer.sender)
            reason = (
                f"transfer {key[1].hex()[:8]} from {transfer.sender!r} abandoned after {self.timeout_s:g} s:"
                f" {len(transfer.received)} of {transfer.count} chunks arrived"
            )
            logger.warning("%s", reason)
            if self._on_abandon is not None:
                self._on_abandon(transfer.sender, reason)
        return len(stale)

    def next_deadline(self) -> float | None:
        """Clock time at which the oldest transfer times out, for a timer rather than polling."""
        if not self._transfers:
            return None
        return min(t.started for t in self._transfers.values()) + self.timeout_s
