"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiomqtt
import msgpack
from prometheus_client.parser import text_string_to_metric_families

from fedmq.broker import BusClient, Envelope, Message, Topics
from fedmq.broker.codec import ALIGN, FORMAT_VERSION, PREFIX, PREFIX_BYTES, checksum

if TYPE_CHECKING:
    from tests.integration.federation import Federation


async def next_message(bus: BusClient, timeout: float = 10.0) -> Envelope:
    it = bus.messages()
    try:
        return await asyncio.wait_for(anext(it), timeout)
    finally:
        await it.aclose()


async def next_matching(bus: BusClient, wanted: Callable[[Message], bool], timeout: float = 20.0) -> Message:
    """The next message `wanted` accepts within `timeout` seconds; others are skipped."""
    async with asyncio.timeout(timeout):
        while True:
            message = (await next_message(bus, timeout)).message
            if wanted(message):
                return message


@contextlib.asynccontextmanager
async def raw_client(url: str) -> AsyncIterator[aiomqtt.Client]:
    """A plain MQTT client that can publish anything, as a hostile or broken peer would."""
    parts = urlsplit(url)
    async with aiomqtt.Client(
        parts.hostname or "127.0.0.1", parts.port or 1883, protocol=aiomqtt.ProtocolVersion.V311
    ) as client:
        yield client


QUICKSTART_STRAGGLERS = [f"faults.node-{i:03d}.delay_s=45" for i in (1, 4, 7, 12, 15)]
"""Overrides making five of the twenty quickstart nodes answer after its 30 s deadline: late in sync,
stale in async."""


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Prometheus samples by name and sorted labels."""


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """As the node hosts train: one torch thread (hosting.threads_per_process), so sums run in one
    order and an in-process run matches a daemon run or its replay bit for bit."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def parse_metrics(body: bytes) -> Samples:
    """Every sample of a /metrics body, parsed by prometheus_client's own parser."""
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def frame_with_header(header: object, body: bytes = b"", *, version: int = FORMAT_VERSION) -> bytes:
    """A frame with a hand-made header and a right prefix and checksum: what a hostile client can send,
    and what reaches the codec's header checks (tests of the codec, its fuzzing, the daemons' fences)."""
    packed = msgpack.packb(header, use_bin_type=True)
    start = (PREFIX_BYTES + len(packed) + ALIGN - 1) // ALIGN * ALIGN
    buf = bytearray(start + len(body))
    buf[PREFIX_BYTES : PREFIX_BYTES + len(packed)] = packed
    buf[start:] = body
    PREFIX.pack_into(buf, 0, b"FMQ", version, len(packed), checksum(buf))
    return bytes(buf)


@contextlib.asynccontextmanager
async def raw_client_with_coordinator_up(fed: Federation, url: str) -> AsyncIterator[aiomqtt.Client]:
    """A raw client (`raw_client`), once `fed`'s coordinator, started here, has published its first
    status: it is connected and subscribed, so what the client sends next reaches it."""
    async with raw_client(url) as client:
        await client.subscribe(Topics(fed.federation).coordinator_status, qos=1)
        fed.start_coordinator()
        async with asyncio.timeout(60):
            await anext(aiter(client.messages))
        yield client
