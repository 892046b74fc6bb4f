"""NodeHostMetrics: a node host's series read from its daemons when scraped, per node where it says
so and summed otherwise; served over HTTP by serve_metrics."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from prometheus_client import CONTENT_TYPE_LATEST

from fedmq.broker.client import BusStats
from fedmq.experiments.build import build_nodes
from fedmq.experiments.config import parse_config
from fedmq.fednode.daemon import NodeDaemon
from fedmq.fednode.metrics import NodeHostMetrics, serve_metrics
from tests.helpers import parse_metrics, value
from tests.integration.federation import base_config

URL = "mqtt://127.0.0.1:1"  # never connected to: the daemons are only built


@pytest.fixture(scope="module")
def daemons() -> list[NodeDaemon]:
    cfg = parse_config(base_config(nodes=3))
    return build_nodes(cfg, URL, cfg.node_ids(), device=torch.device("cpu"))


def _bus(connected: bool, **counts: int) -> SimpleNamespace:
    rejected = {k.replace("_", "-"): v for k, v in counts.items() if not hasattr(BusStats, k)}
    stats = BusStats(**{k: v for k, v in counts.items() if hasattr(BusStats, k)})
    stats.rejected.update(rejected)
    return SimpleNamespace(stats=stats, connected=connected)


def test_node_host_metrics_give_three_series_per_node_and_the_host_sums_of_the_rest(
    daemons: list[NodeDaemon], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three nodes (one connected, one never started, one connected but offline by its scenario):
    per-node tasks received (scenario-dropped and offline ones included), updates sent and connected;
    everything else summed."""
    first, second, third = daemons
    states = {
        first: {"sent": 4, "trainings": 5, "train_seconds": 1.5},
        second: {"sent": 0, "trainings": 0, "train_seconds": 0.0},
        third: {"sent": 2, "trainings": 2, "train_seconds": 0.25},
    }
    for daemon, attrs in states.items():
        for name, v in attrs.items():
            monkeypatch.setattr(daemon.updates, name, v)
    players = {first: (6, 1, 1, 1), second: (0, 0, 0, 0), third: (2, 0, 3, 0)}
    for daemon, counts in players.items():  # tasks received online, dropped, came while offline, abandoned
        for name, v in zip(("tasks_received", "dropped", "ignored_offline", "abandoned"), counts, strict=True):
            monkeypatch.setattr(daemon.player, name, v)
    monkeypatch.setattr(third.player, "online", False)
    monkeypatch.setattr(first, "_bus", _bus(True, received=10, bytes_in=4000, bytes_out=900, published=6, bad_task=1))
    monkeypatch.setattr(third, "_bus", _bus(True, received=3, bytes_in=100, bytes_out=50, reconnects=1, bad_task=2,
                                            training_error=1))  # fmt: skip
    body, content_type = NodeHostMetrics(daemons).render()
    assert content_type == CONTENT_TYPE_LATEST
    s = parse_metrics(body)
    ids = [d.node_id for d in daemons]
    assert [value(s, "fedmq_node_tasks_received_total", node=n) for n in ids] == [7, 0, 5]
    assert [value(s, "fedmq_node_updates_sent_total", node=n) for n in ids] == [4, 0, 2]
    assert [value(s, "fedmq_node_connected", node=n) for n in ids] == [1, 0, 1]
    assert value(s, "fedmq_host_nodes") == 3 and value(s, "fedmq_host_nodes_online") == 1
    abandoned = {
        r: value(s, "fedmq_host_tasks_abandoned_total", reason=r) for r in ("dropped", "offline", "went_offline")
    }
    assert abandoned == {"dropped": 1, "offline": 4, "went_offline": 1}
    assert value(s, "fedmq_host_trainings_total") == 7 and value(s, "fedmq_host_training_seconds_total") == 1.75
    bus = {"fedmq_bus_received_messages_total": 13, "fedmq_bus_received_bytes_total": 4100,
           "fedmq_bus_sent_bytes_total": 950, "fedmq_bus_published_messages_total": 6,
           "fedmq_bus_reconnects_total": 1, "fedmq_bus_duplicate_messages_total": 0}  # fmt: skip
    assert {name: value(s, name) for name in bus} == bus
    rejected = {dict(labels)["reason"]: v for (name, labels), v in s.items() if name == "fedmq_rejected_messages_total"}
    assert rejected == {"bad-task": 3, "training-error": 1}
    assert not any(dict(labels).get("node") for (name, labels) in s if name.startswith("fedmq_host_"))


async def test_serve_metrics_answers_a_scrape_over_http_with_what_render_gives_now() -> None:
    """Port 0 picks a free port; each GET /metrics calls render() afresh with its content type; other
    paths are 404."""
    calls = []

    def render() -> tuple[bytes, str]:
        calls.append(1)
        return f"fedmq_test {len(calls)}\n".encode(), CONTENT_TYPE_LATEST

    async with serve_metrics(render, "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        for expected in (1, 2):
            async with http.get(f"{url}/metrics") as response:
                assert response.status == 200 and response.headers["Content-Type"] == CONTENT_TYPE_LATEST
                assert value(parse_metrics(await response.read()), "fedmq_test") == expected
        async with http.get(f"{url}/") as response:
            assert response.status == 404
    assert len(calls) == 2


async def test_serve_metrics_on_a_taken_port_raises_oserror() -> None:
    """The address in use is an OSError (the CLI turns it into exit code 2)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError):
            async with serve_metrics(lambda: (b"", CONTENT_TYPE_LATEST), "127.0.0.1", port):
                pass
