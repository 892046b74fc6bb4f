"""Keep freed chunk-sized memory in the process, so that the next chunk does not page-fault.

A 45 MB model travels as 1 MiB chunks: the sender encodes each into a new frame and paho copies it
into a new packet; the receiver reads each packet into a new buffer. glibc hands allocations of
over 128 KiB (its default, adjusted as blocks are freed) to mmap, and gives freed heap tops back to
the kernel at 128 KiB of slack: so each chunk buffer came as fresh pages and every 4 KiB page of it
cost a page fault on first touch. That was half the CPU time of a transfer (``fedmq bench
transport``: 0.55 GB/s to one node before, 1.08 GB/s after, the same run otherwise).

`tune` raises glibc's mmap threshold above the chunk size, lets up to `keep_bytes` of freed
memory stay in the heap for reuse, and grows the heap by that much at a time (without the padding,
a process that imported torch still faulted: 0.65 instead of 1.1 GB/s): a process holds up to
`keep_bytes` more, in exchange. It is process-wide and idempotent; on a C library without
``mallopt`` (musl, macOS) it does nothing. It asks through `fedmq.malloc`, which keeps whatever keeps more
of the training's own setting (`fedcore.host_memory`) in a process that asks for both.
"""

from __future__ import annotations

import logging
import threading

from fedmq.malloc import M_MMAP_THRESHOLD, M_TOP_PAD, M_TRIM_THRESHOLD, keep

logger = logging.getLogger(__name__)

KEEP_BYTES = 64 * 2**20
"""Freed heap kept for reuse, and the step the heap grows by: what a process may hold in addition."""
MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc refuses larger mmap thresholds on 64-bit (HEAP_MAX_SIZE / 2)."""

_lock = threading.Lock()
_applied: tuple[int, int] | None = None


def _threshold(chunk_bytes: int) -> int:
    """Above a chunk's frame and paho's packet around it, with room for two."""
    return min(max(4 * 2**20, 2 * chunk_bytes + 2**16), MMAP_THRESHOLD_MAX)


def tune(chunk_bytes: int, keep_bytes: int = KEEP_BYTES) -> bool:
    """Serve buffers up to a few chunks from the heap and keep `keep_bytes` of freed heap; True if applied.

    Only ever raises the settings: a process with two clients of different chunk sizes keeps the larger.
    """
    global _applied
    threshold = _threshold(chunk_bytes)
    with _lock:
        if _applied is not None and _applied[0] >= threshold and _applied[1] >= keep_bytes:
            return True
        if _applied is not None:
            threshold, keep_bytes = max(threshold, _applied[0]), max(keep_bytes, _applied[1])
        ok = keep({M_MMAP_THRESHOLD: threshold, M_TRIM_THRESHOLD: keep_bytes, M_TOP_PAD: keep_bytes})
        if ok:
            _applied = (threshold, keep_bytes)
        else:
            logger.debug("no mallopt, or it refused mmap threshold %d / trim threshold %d", threshold, keep_bytes)
        return ok


def applied() -> tuple[int, int] | None:
    """(mmap threshold, trim threshold) this process set, or None."""
    return _applied


def child_env(base: dict[str, str], chunk_bytes: int = 2**20, keep_bytes: int = KEEP_BYTES) -> dict[str, str]:
    """`base` with the same glibc settings as environment variables, for a C broker we start (mosquitto
    reads each chunk into a new buffer too); settings already in `base` are left as they are."""
    env = dict(base)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(_threshold(chunk_bytes)))
    env.setdefault("MALLOC_TRIM_THRESHOLD_", str(keep_bytes))
    env.setdefault("MALLOC_TOP_PAD_", str(keep_bytes))
    return env
