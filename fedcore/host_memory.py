"""Keep the host memory a process frees for its next allocations, instead of handing it back to the kernel.

torch allocates a CPU tensor with the C library's `malloc`. glibc serves an allocation above its mmap
threshold (128 KiB, raised as mapped chunks are freed, to at most 32 MiB) with a fresh mapping and unmaps it
when it is freed, and it hands the free top of its heap back to the kernel past a trim threshold. Either
way the next tensor of that size faults its pages in again, and the kernel zeroes each one first. A
vectorised round's large tensors (the K nodes' stacked weights, their gradients, their activations: 38 MB
for one layer of FedSA's ResNet-18 stacked for four nodes) are above any threshold glibc reaches, so every
step paid for them again. On the project's 2-core CPU a vectorised round of that workload (4 nodes of 20
images) faulted about 280,000 pages and spent half its time in the kernel (`fedmq bench sim`, its FedSA
section, docs/simulation.md).

`set_host_memory("keep")` asks glibc (`mallopt`) to serve every allocation from its heap (`M_MMAP_MAX` 0)
and to keep the heap's free top (`M_TRIM_THRESHOLD` at its largest), so that the pages one step frees serve
the next, as torch's caching allocator keeps a GPU's memory. Both are needed: without mappings the heap's top
is trimmed at every step instead. The cost is that the process keeps its peak heap until it ends. Threads
other than the main one allocate from glibc's other arenas, which still map what does not fit their heaps.
The arithmetic does not change: the same bits. Where the C library has no `mallopt`, nothing is done.
"""

from __future__ import annotations

from typing import Literal

from fedmq.malloc import M_MMAP_MAX, M_TRIM_THRESHOLD, keep

HostMemory = Literal["keep", "system"]
"""`keep`: every allocation from the heap, and freed memory kept in it; `system`: the C library's own policy."""

INT_MAX = 2**31 - 1
"""The largest value `mallopt` takes (an int): the heap's free top is kept up to 2 GiB."""


def set_host_memory(mode: HostMemory) -> bool:
    """Apply `mode` to the whole process, for the rest of its life: `keep` as the module says (through
    `fedmq.malloc`, so that the bus's own setting, `broker.allocator`, asked before or after, does not undo
    it); `system` does nothing (a process that kept its memory goes on keeping it). Returns whether glibc
    took `keep` (False for `system`, and where the C library has no `mallopt`)."""
    if mode == "system":
        return False
    if mode != "keep":
        raise ValueError(f"host memory {mode!r}: expected keep or system")
    return keep({M_MMAP_MAX: 0, M_TRIM_THRESHOLD: INT_MAX})
