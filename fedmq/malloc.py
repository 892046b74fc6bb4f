"""glibc's malloc settings for the whole process (`mallopt`), set in one place, so that whichever part
asks to keep more freed memory wins, whatever the order of the asking.

Two parts of fedmq ask glibc to keep freed memory for reuse instead of handing it back to the kernel,
each for its own large buffers: the bus for its chunk buffers (`broker.allocator`), the training for its
tensors (`fedcore.host_memory`). Each is a setting of the whole process, and a node process may ask for
both. Both ask here, and a setting only ever changes toward keeping more (a larger threshold or pad, fewer
mappings), so the one asked later cannot undo the other.

This module is on the floor under every layer, as `fedmq.fields` is: it imports only the standard
library (tests/test_boundaries.py). On a C library without `mallopt` (macOS) nothing is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections.abc import Callable, Mapping

M_TRIM_THRESHOLD = -1
"""Free memory at the heap's top beyond this is handed back to the kernel."""
M_TOP_PAD = -2
"""The heap grows by this much more than asked, at a time."""
M_MMAP_THRESHOLD = -3
"""An allocation of at least this is a mapping of its own, unmapped when freed (glibc caps it at 32 MiB)."""
M_MMAP_MAX = -4
"""How many mappings of their own glibc may hold at once: 0 serves every allocation from the heap."""

_KEEP_MORE_WHEN_LOWER = frozenset({M_MMAP_MAX})
"""The options for which a smaller value keeps more memory; for the others a larger one does."""

_lock = threading.Lock()
_set: dict[int, int] = {}


def _mallopt() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallopt
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def _keeps_no_more(option: int, value: int, before: int) -> bool:
    return value >= before if option in _KEEP_MORE_WHEN_LOWER else value <= before


def keep(settings: Mapping[int, int]) -> bool:
    """Set each option to its value, unless this process already set it to keep at least as much. True
    when every option holds such a value afterwards; False where the C library has no `mallopt` or
    refused a value (the settings it took stay)."""
    with _lock:
        mallopt = _mallopt()
        if mallopt is None:
            return False
        held = True
        for option, value in settings.items():
            before = _set.get(option)
            if before is not None and _keeps_no_more(option, value, before):
                continue
            if mallopt(option, value) == 1:
                _set[option] = value
            else:
                held = False
        return held


def settings() -> dict[int, int]:
    """The options this process set through `keep`, and their values."""
    with _lock:
        return dict(_set)
