"""Transport: one large model from the coordinator to 1 and to 10 nodes through the broker, end to end,
against a raw TCP socket moving the same bytes between the same processes (the limit); and the
round trip of a small message through the broker against the same round trip over a raw socket.

End to end means from the start of encoding in the sender to the decoded message (tensors as views)
in every receiver: encode, chunk, publish, the broker's fan-out, reassembly, verification, decode.
Receivers live in other processes, as node daemons do (10 receivers: two processes of five
connections each, as `fedmq run` hosts nodes on two cores); they report when each message was
complete on the monotonic clock, which Linux shares between processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue as queue_mod
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiomqtt
import numpy as np

from fedmq.broker import BusClient, BusConfig, allocator
from fedmq.broker.client import quiet_pending_publishes
from fedmq.broker.codec import encode
from fedmq.broker.message import Kind, Message
from fedmq.broker.tuning import tune_process
from fedmq.experiments.bench.brokers import broker_kind, running_broker
from fedmq.experiments.bench.common import MIB, BenchOptions, Report, throughput

TITLE = "45 MB to 1 and 10 nodes through the broker against a raw TCP socket; small-message round trips"

FED = "bench"
_CTX = mp.get_context("spawn")  # no fork of a process that runs threads and an event loop


@dataclass(frozen=True, slots=True)
class Sizes:
    model_bytes: int
    fanout: tuple[int, ...]
    repeats: int
    pings: int
    chunk_bytes: int = 2**20


def sizes(options: BenchOptions) -> Sizes:
    chunk = int(float(options.extra.get("chunk_mb", 1)) * 2**20)
    if options.quick:
        return Sizes(4 * 2**20, (1, 2), options.reps(3, 2), 20, chunk)
    model = int(options.extra.get("model_mb", 45)) * 10**6
    fanout = tuple(int(x) for x in str(options.extra.get("nodes", "1,10")).split(","))
    return Sizes(model, fanout, options.reps(11), 200, chunk)  # 45 MB moves in ~40 ms: medians of 11 are steadier


def model_message(nbytes: int, rep: int) -> Message:
    """A model-shaped message: a few large float32 tensors and many small ones, `nbytes` in all."""
    rng = np.random.default_rng(rep)
    small = [rng.standard_normal(256, dtype=np.float32) for _ in range(40)]
    rest = (nbytes - sum(a.nbytes for a in small)) // 4
    big = [rng.standard_normal(n, dtype=np.float32) for n in (rest // 2, rest // 4, rest - rest // 2 - rest // 4)]
    tensors = {f"model/t{i}": a for i, a in enumerate(big + small)}
    return Message(kind=Kind.MODEL, federation=FED, round=0, sender="coordinator", meta={"rep": rep}, tensors=tensors)


# -- receivers (child processes) ---------------------------------------------------------------------


def _bus_receivers(
    url: str, topic: str, clients: int, first: int, reports: Any, ready: Any, chunk_bytes: int = 2**20
) -> None:
    asyncio.run(_bus_receive(url, topic, clients, first, reports, ready, chunk_bytes))


async def _bus_receive(
    url: str, topic: str, clients: int, first: int, reports: Any, ready: Any, chunk_bytes: int
) -> None:
    config = BusConfig.from_url(url, persistent_session=False, chunk_bytes=chunk_bytes)
    tune_process(config)  # a receiver process is an entry point, as a node host is

    async def one(index: int, started: asyncio.Event) -> None:
        async with BusClient(config, client_id=f"bench-rx-{index}-{time.monotonic_ns()}", federation=FED) as bus:
            await bus.subscribe(topic)
            started.set()
            async for envelope in bus.messages():
                done = time.monotonic()
                message = envelope.message
                if message.kind == Kind.MODEL:
                    reports.put((index, message.meta["rep"], done, envelope.size, message.nbytes))
                elif message.meta.get("stop"):
                    return

    events = [asyncio.Event() for _ in range(clients)]
    tasks = [asyncio.create_task(one(first + i, e)) for i, e in enumerate(events)]
    await asyncio.gather(*(e.wait() for e in events))
    ready.put(clients)
    await asyncio.gather(*tasks)


def _bare_receiver(port: int, topic: str, per_transfer: int, reports: Any, ready: Any) -> None:
    """aiomqtt alone, no fedmq: counts messages and reports when each transfer's last one arrived.
    With fedmq's allocator settings (`broker.allocator`), so that the comparison is of the code."""
    allocator.tune(2**20)

    async def main() -> None:
        options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        async with aiomqtt.Client("127.0.0.1", port, identifier=f"bare-rx-{time.monotonic_ns()}",
                                  socket_options=options) as client:  # fmt: skip
            await client.subscribe(topic, qos=1)
            ready.put(1)
            count = 0
            async for message in client.messages:
                if message.payload == b"stop":
                    return
                count += 1
                if count % per_transfer == 0:
                    reports.put((0, count // per_transfer - 1, time.monotonic(), 0, 0))

    asyncio.run(main())


def bare_transfer(url: str, nbytes: int, repeats: int, chunk_bytes: int) -> list[float]:
    """The same bytes as chunk-sized MQTT messages published concurrently with aiomqtt alone (no
    framing, checksums, reassembly or decoding): what the MQTT client library itself allows."""
    port = int(url.rsplit(":", 1)[1])
    topic = f"bench/bare/{time.monotonic_ns()}"
    sizes = [chunk_bytes] * (nbytes // chunk_bytes) + ([nbytes % chunk_bytes] if nbytes % chunk_bytes else [])
    reports, ready = _CTX.Queue(), _CTX.Queue()
    with _processes(_bare_receiver, [(port, topic, len(sizes), reports, ready)]):
        ready.get(timeout=60)
        return asyncio.run(_bare_send(port, topic, sizes, repeats, reports))


async def _bare_send(port: int, topic: str, sizes: list[int], repeats: int, reports: Any) -> list[float]:
    allocator.tune(max(sizes))
    out = []
    payloads = [bytes(n) for n in sizes]
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    log = logging.getLogger("fedmq.bench.bare")
    log.addFilter(quiet_pending_publishes)  # concurrent publishing is the point here
    async with aiomqtt.Client("127.0.0.1", port, identifier=f"bare-tx-{time.monotonic_ns()}",
                              max_inflight_messages=64, socket_options=options, logger=log) as client:  # fmt: skip
        for rep in range(repeats + 1):
            started = time.monotonic()
            await asyncio.gather(*(client.publish(topic, p, qos=1) for p in payloads))
            done = await asyncio.to_thread(_collect, reports, 1)
            if rep > 0:
                out.append(done[0][2] - started)
        await client.publish(topic, b"stop", qos=1)
    return out


def _tcp_receivers(port: int, clients: int, first: int, nbytes: int, repeats: int, reports: Any, ready: Any) -> None:
    """Each connection reads `repeats` transfers of `nbytes` into one preallocated buffer."""

    def one(index: int) -> None:
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"r")  # connected: the sender may count this receiver
            for rep in range(repeats):
                got = 0
                while got < nbytes:
                    n = sock.recv_into(view[got:], nbytes - got)
                    if n == 0:
                        return
                    got += n
                reports.put((index, rep, time.monotonic(), nbytes, nbytes))

    threads = [threading.Thread(target=one, args=(first + i,)) for i in range(clients)]
    for t in threads:
        t.start()
    ready.put(clients)
    for t in threads:
        t.join()


def _split(total: int, parts: int = 2) -> list[int]:
    parts = min(parts, total)
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


@contextlib.contextmanager
def _processes(target: Any, args_for: list[tuple[Any, ...]]) -> Iterator[list[Any]]:
    procs = [_CTX.Process(target=target, args=args, daemon=True) for args in args_for]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)


def _collect(reports: Any, expected: int, timeout_s: float = 120.0) -> list[tuple[int, int, float, int, int]]:
    out: list[tuple[int, int, float, int, int]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected:
        try:
            out.append(reports.get(timeout=max(deadline - time.monotonic(), 0.01)))
        except queue_mod.Empty:
            raise TimeoutError(f"only {len(out)} of {expected} receipts within {timeout_s:g} s") from None
    return out


# -- the measurements --------------------------------------------------------------------------------


def bus_transfer(url: str, nodes: int, nbytes: int, repeats: int, chunk_bytes: int = 2**20) -> list[float]:
    """Seconds from encoding to the last receiver's decoded message, per repetition."""
    topic = f"fedmq/{FED}/model/bench-{time.monotonic_ns()}"
    reports, ready = _CTX.Queue(), _CTX.Queue()
    counts = _split(nodes)
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    args = [(url, topic, c, f, reports, ready, chunk_bytes) for c, f in zip(counts, firsts, strict=True)]
    with _processes(_bus_receivers, args):
        for _ in counts:
            ready.get(timeout=60)
        return asyncio.run(_send_models(url, topic, nodes, nbytes, repeats, reports, chunk_bytes))


async def _send_models(
    url: str, topic: str, nodes: int, nbytes: int, repeats: int, reports: Any, chunk_bytes: int = 2**20
) -> list[float]:
    config = BusConfig.from_url(url, persistent_session=False, chunk_bytes=chunk_bytes)
    tune_process(config)  # as the coordinator's entry point does
    out = []
    async with BusClient(config, client_id=f"bench-tx-{time.monotonic_ns()}", federation=FED) as bus:
        buffer = bytearray()
        messages = [model_message(nbytes, rep) for rep in range(repeats + 1)]  # built before the clock starts
        for rep, message in enumerate(messages):
            started = time.monotonic()
            frame = encode(message, buffer)
            await bus.publish_frame(topic, frame, round=0)
            got = await asyncio.to_thread(_collect, reports, nodes)
            if rep > 0:  # the first transfer warms up connections and buffers
                out.append(max(t for _, _, t, _, _ in got) - started)
        await bus.publish(topic, Message(kind=Kind.ACK, federation=FED, round=0, sender="tx", meta={"stop": True}))
    return out


def tcp_transfer(nodes: int, nbytes: int, repeats: int) -> list[float]:
    """The same bytes over plain TCP sockets from this process to `nodes` receivers in two processes,
    sent to all of them at once (one thread per connection)."""
    payload = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    reports, ready = _CTX.Queue(), _CTX.Queue()
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.listen(nodes)
        port = server.getsockname()[1]
        counts = _split(nodes)
        firsts = [sum(counts[:i]) for i in range(len(counts))]
        args = [(port, c, f, nbytes, repeats + 1, reports, ready) for c, f in zip(counts, firsts, strict=True)]
        with _processes(_tcp_receivers, args):
            conns = []
            for _ in range(nodes):
                conn, _ = server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.recv(1)
                conns.append(conn)
            out = []
            for rep in range(repeats + 1):
                started = time.monotonic()
                senders = [threading.Thread(target=c.sendall, args=(payload,)) for c in conns]
                for t in senders:
                    t.start()
                got = _collect(reports, nodes)
                for t in senders:
                    t.join()
                if rep > 0:
                    out.append(max(t for _, _, t, _, _ in got) - started)
            for c in conns:
                c.close()
    return out


def _bus_echo(url: str, ping: str, pong: str, ready: Any) -> None:
    async def main() -> None:
        config = BusConfig.from_url(url, persistent_session=False)
        async with BusClient(config, client_id=f"bench-echo-{time.monotonic_ns()}", federation=FED) as bus:
            await bus.subscribe(ping)
            ready.put(1)
            async for envelope in bus.messages():
                if envelope.message.meta.get("stop"):
                    return
                await bus.publish(pong, envelope.message)

    asyncio.run(main())


def bus_round_trip(url: str, count: int) -> list[float]:
    """Seconds for a small message to go out through the broker and come back from another process."""
    stamp = time.monotonic_ns()
    ping, pong = f"fedmq/{FED}/ping/{stamp}", f"fedmq/{FED}/pong/{stamp}"
    ready = _CTX.Queue()
    with _processes(_bus_echo, [(url, ping, pong, ready)]):
        ready.get(timeout=60)
        return asyncio.run(_pings(url, ping, pong, count))


async def _pings(url: str, ping: str, pong: str, count: int) -> list[float]:
    config = BusConfig.from_url(url, persistent_session=False)
    out = []
    async with BusClient(config, client_id=f"bench-ping-{time.monotonic_ns()}", federation=FED) as bus:
        await bus.subscribe(pong)
        replies = bus.messages()
        for i in range(count + 5):
            message = Message(kind=Kind.ACK, federation=FED, round=0, sender="ping", meta={"i": i, "pad": b"x" * 100})
            started = time.monotonic()
            await bus.publish(ping, message)
            await anext(replies)
            if i >= 5:
                out.append(time.monotonic() - started)
        await bus.publish(ping, Message(kind=Kind.ACK, federation=FED, round=0, sender="ping", meta={"stop": True}))
    return out


def _tcp_echo(port: int, size: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            data = sock.recv(size)
            if not data:
                return
            sock.sendall(data)


def tcp_round_trip(count: int, size: int = 200) -> list[float]:
    payload = b"x" * size
    with socket.create_server(("127.0.0.1", 0)) as server, _processes(_tcp_echo, [(server.getsockname()[1], size)]):
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out = []
            for i in range(count + 5):
                started = time.monotonic()
                conn.sendall(payload)
                got = 0
                while got < size:
                    got += len(conn.recv(size - got))
                if i >= 5:
                    out.append(time.monotonic() - started)
    return out


def run(options: BenchOptions) -> Report:
    s = sizes(options)
    kind = broker_kind(options)
    report = Report(
        "transport",
        TITLE,
        context={
            "model": f"{s.model_bytes / 1e6:.0f} MB ({s.model_bytes / MIB:.1f} MiB) of float32",
            "broker": kind,
            "chunk": f"{s.chunk_bytes / MIB:g} MiB",
            "QoS": 1,
            "repeats": s.repeats,
            "statistic": "median",
        },
    )
    with running_broker(options) as url:
        for nodes in s.fanout:
            tcp = statistics.median(tcp_transfer(nodes, s.model_bytes, s.repeats))
            bus = statistics.median(bus_transfer(url, nodes, s.model_bytes, s.repeats, s.chunk_bytes))
            section = f"{s.model_bytes / 1e6:.0f} MB to {nodes} node{'s' if nodes > 1 else ''}"
            report.add(
                "raw TCP sockets (the limit)", tcp * 1e3, "ms", section=section,
                note=f"{throughput(s.model_bytes * nodes, tcp):.2f} GB/s delivered",
            )  # fmt: skip
            report.add(
                f"**fedmq over {kind}**, end to end", bus * 1e3, "ms", section=section,
                ratio=tcp / bus, ratio_means="the raw socket's throughput",
                note=f"{throughput(s.model_bytes * nodes, bus):.2f} GB/s delivered",
            )  # fmt: skip
            if nodes == 1 and kind != "embedded":
                bare = statistics.median(bare_transfer(url, s.model_bytes, s.repeats, s.chunk_bytes))
                report.add(
                    "aiomqtt alone, the same bytes as chunk-sized messages", bare * 1e3, "ms", section=section,
                    ratio=tcp / bare, ratio_means="the raw socket's throughput",
                    note=f"{throughput(s.model_bytes, bare):.2f} GB/s; no framing, checks or decoding",
                )  # fmt: skip
            if nodes == 1:
                rate = throughput(s.model_bytes, bus)
                report.target(
                    f"{s.model_bytes / 1e6:.0f} MB to one node >= 1 GB/s end to end", f"{rate:.2f} GB/s", rate >= 1.0
                )
        pings = bus_round_trip(url, s.pings)
    tcp_ping = statistics.median(tcp_round_trip(s.pings))
    bus_ping = statistics.median(pings)
    section = "small message (about 200 bytes), round trip between two processes"
    report.add("raw TCP socket (the limit)", tcp_ping * 1e3, "ms", section=section)
    report.add(
        f"**fedmq over {kind}** (QoS 1, through the broker)", bus_ping * 1e3, "ms", section=section,
        ratio=bus_ping / tcp_ping, ratio_means="the raw socket's time",
    )  # fmt: skip
    if kind == "mosquitto" and not options.quick and options.extra.get("embedded", "1") != "0":
        with running_broker(options, kind="embedded") as url:
            slow = statistics.median(bus_round_trip(url, s.pings // 2))
        report.add(
            "fedmq over the embedded broker (amqtt)", slow * 1e3, "ms", section=section,
            ratio=slow / tcp_ping, ratio_means="the raw socket's time",
        )  # fmt: skip
    return report
