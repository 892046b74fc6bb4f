"""The HTTP API's parts that need no running federation: addresses, the token file, KDIA's teacher
log read incrementally, and a slow event-stream client cut off instead of buffered without bound."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.observers.http import (
    STREAM_QUEUE,
    LiveState,
    TeacherTail,
    is_loopback,
    parse_address,
    read_token,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8080", ("127.0.0.1", 8080)),
        ("0", ("127.0.0.1", 0)),
        ("0.0.0.0:9000", ("0.0.0.0", 9000)),
        ("[::1]:9000", ("::1", 9000)),
        (":9000", ("127.0.0.1", 9000)),
    ],
)
def test_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:http", "1.2.3.4:70000", "-1"])
def test_bad_addresses_say_what_to_give(text: str) -> None:
    with pytest.raises(CoordinatorError, match="give PORT or HOST:PORT"):
        parse_address(text)


def test_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.org")


def test_token_file(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text("  abcdefghijklmnopqrstuvwxyz  \nsecond line ignored\n")
    assert read_token(good) == "abcdefghijklmnopqrstuvwxyz"
    for content in ["", "\n\n", "short"]:
        good.write_text(content)
        with pytest.raises(CoordinatorError, match="shorter than 16 characters"):
            read_token(good)
    with pytest.raises(CoordinatorError, match="cannot read the HTTP token file"):
        read_token(tmp_path / "missing")


def _weights(round_: int, nodes: int) -> str:
    return "".join(json.dumps({"round": round_, "node_id": f"n{i}", "weight": 1 / nodes}) + "\n" for i in range(nodes))


def test_teacher_tail_reads_only_what_was_added_and_keeps_the_latest_round(tmp_path: Path) -> None:
    log = tmp_path / "teacher_weights.jsonl"
    tail = TeacherTail(log)
    assert tail.latest() == {"round": None, "weights": []}  # KDIA has not written it yet, or another method
    log.write_text(_weights(0, 3))
    assert tail.latest()["round"] == 0 and len(tail.latest()["weights"]) == 3
    first_offset = tail.offset
    with log.open("a") as fh:  # round 1, and half a line of round 2 (the writer is mid-line)
        fh.write(_weights(1, 4) + '{"round": 2, "node_')
    latest = tail.latest()
    assert latest["round"] == 1 and [w["node_id"] for w in latest["weights"]] == ["n0", "n1", "n2", "n3"]
    assert tail.offset > first_offset and tail.partial == b'{"round": 2, "node_'
    with log.open("a") as fh:
        fh.write('id": "n0", "weight": 1.0}\n')
    assert tail.latest() == {"round": 2, "weights": [{"round": 2, "node_id": "n0", "weight": 1.0}]}


async def test_a_slow_stream_client_is_cut_off_and_told() -> None:
    live = LiveState(SimpleNamespace(watchers=[]))  # type: ignore[arg-type]  # publish needs no coordinator
    fast: asyncio.Queue[Any] = asyncio.Queue(STREAM_QUEUE)
    slow: asyncio.Queue[Any] = asyncio.Queue(3)
    live.clients |= {fast, slow}
    for i in range(5):
        live.publish("record", {"round": i})
    assert live.clients == {fast} and live.cut_off == 1
    drained = [slow.get_nowait() for _ in range(slow.qsize())]
    assert drained[-1] is None  # the end of its stream: its EventSource reconnects and reloads the state
    assert [fast.get_nowait()[1]["round"] for _ in range(5)] == [0, 1, 2, 3, 4]
