"""The process-wide settings that make large transfers fast, for entry points to apply once.

Both change the whole process, not one client, so no constructor or import makes them: glibc's
allocator keeps chunk buffers for reuse (`broker.allocator`, when `BusConfig.tune_allocator`), and
paho decodes a PUBLISH without copying its payload (`broker.paho_fast.install`). A library user who
builds a `BusClient` without calling this gets correct but slower transfers.
"""

from __future__ import annotations

from fedmq.broker import allocator, paho_fast
from fedmq.broker.config import BusConfig


def tune_process(config: BusConfig) -> None:
    """Apply the settings `config` asks for; idempotent, and a second config only ever raises them."""
    if config.tune_allocator:
        allocator.tune(config.chunk_bytes)
    paho_fast.install()
