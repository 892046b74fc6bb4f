"""The coordinator's HTTP API (`--http`), over real HTTP, of a federation of real processes on a real
broker: the JSON views, the event stream, the token, `fedmq status`, and the dashboard in a real
headless browser (Debian's chromium)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser import Browser, require_chromium
from tests.integration.federation import Federation, base_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("FEDMQ_TEST_ARTIFACTS", ROOT / "runs" / "test-artifacts"))
TOKEN = "s3cret-token-for-the-test-0123456789"


async def api_url(fed: Federation, timeout: float = 60) -> str:
    """The API's address, once the coordinator has written it (it listens on a port the system chose)."""
    path = fed.out / "http.json"
    async with asyncio.timeout(timeout):
        while not path.exists():
            assert fed.coordinator is not None and fed.coordinator.poll() is None, fed.log("coordinator.log")
            await asyncio.sleep(0.1)
    return str(json.loads(path.read_text())["url"])


async def get(session: aiohttp.ClientSession, url: str, token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.get(url, headers=headers) as response:
        body = await response.json() if response.content_type == "application/json" else await response.text()
        return response.status, body


async def read_events(session: aiohttp.ClientSession, url: str, into: list[tuple[str, Any]]) -> None:
    """Server-sent events until the stream ends (the `end` event closes it)."""
    async with session.get(url + "api/events", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        kind = None
        async for raw in response.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                into.append((str(kind), json.loads(line[6:])))


async def test_the_api_follows_a_federation_and_agrees_with_its_run_directory(tmp_path: Path, broker_url: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    fed = Federation(tmp_path, broker_url, base_config(rounds=4))
    fed.start_coordinator("--http", "127.0.0.1:0", "--http-token-file", str(token_file))
    try:
        url = await api_url(fed)
        async with aiohttp.ClientSession() as session:
            # the probes answer without the token, everything else wants it
            assert await get(session, url + "healthz", None) == (200, {"ok": True})
            async with asyncio.timeout(30):
                while (await get(session, url + "readyz", None))[0] != 200:
                    await asyncio.sleep(0.1)
            code, body = await get(session, url + "api/status", None)
            assert code == 401 and "bearer token" in body["error"]
            assert (await get(session, url + "api/status", "wrong-token-of-some-length"))[0] == 401
            code, status = await get(session, url + "api/status")
            assert code == 200 and status["state"] == "waiting" and status["rounds"] == 4
            assert status["federation"] == fed.federation and status["method"] == "fedavg"
            code, config = await get(session, url + "api/config")
            assert code == 200 and config["rounds"] == 4 and config["nodes"] == 4
            assert await get(session, url + "api/nodes") == (200, [])
            async with session.get(url + f"?token={TOKEN}", allow_redirects=False) as moved:
                assert moved.status == 303  # the token moves into an HttpOnly cookie, out of the URL
                cookie = moved.cookies["fedmq_token"].value
            async with session.get(url, headers={"Cookie": f"fedmq_token={cookie}"}) as page:
                assert page.status == 200 and "<title>fedmq dashboard</title>" in await page.text()

            events: list[tuple[str, Any]] = []
            stream = asyncio.create_task(read_events(session, url, events))
            await asyncio.sleep(0.5)
            fed.start_nodes("node-000", "node-001", "node-002", "node-003")
            async with asyncio.timeout(120):
                while not any(kind == "record" for kind, _ in events):
                    await asyncio.sleep(0.05)
            code, mid = await get(session, url + "api/rounds?since=0")
            assert code == 200 and 1 <= mid["total"] <= 4
            nodes_mid = (await get(session, url + "api/nodes"))[1]
            assert sorted(n["node_id"] for n in nodes_mid) == [f"node-00{i}" for i in range(4)]
            # Prometheus scrapes the same port, with the token, during the run
            async with session.get(url + "metrics", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
                assert response.status == 200 and response.content_type == "text/plain"
                scraped = {s.name: s.value for f in text_string_to_metric_families(await response.text())
                           for s in f.samples}  # fmt: skip
            assert 1 <= scraped["fedmq_rounds_completed_total"] <= 4
            assert scraped["fedmq_live_nodes"] == 4
            async with asyncio.timeout(120):
                await stream  # ends with the run
    finally:
        code = await asyncio.to_thread(fed.wait)
    assert code == 0, fed.log("coordinator.log")

    # the stream carried every metrics line, in order, as the run directory has them
    records = [data for kind, data in events if kind == "record"]
    assert records == fed.metrics()
    assert [kind for kind, _ in events][-1] == "end" and events[-1][1]["state"] == "finished"
    nodes = {data["node"] for kind, data in events if kind == "node"}
    assert nodes == {f"node-00{i}" for i in range(4)}
    # one update event per accepted update, each with the bytes the node sent
    updates = [data for kind, data in events if kind == "update"]
    outcomes = [(r["round"], r["attempt"], r["late"], r["lost"], r["rejected"]) for r in records]
    assert len(updates) == sum(len(r["accepted"]) for r in records) == 16, outcomes
    assert all(u["bytes_in"] > 0 and u["staleness"] == 0 for u in updates)
    # mid-run, each node's participation was the record's at that time: at most the final one
    final = fed.participation()
    for node in nodes_mid:
        assert node["participation"]["count"] <= final[node["node_id"]]["count"]


def test_status_command_prints_the_state_and_refuses_without_the_token(tmp_path: Path, embedded_broker: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    fed = Federation(tmp_path, embedded_broker, base_config(rounds=5))
    fed.start_coordinator("--http", "0", "--http-token-file", str(token_file))
    try:
        url = asyncio.run(api_url(fed))
        status = fedmq("status", str(fed.out), "--token-file", str(token_file))
        assert status.returncode == 0, status.stderr
        assert f"{fed.federation} fedavg (sync): waiting, round 0/5, live nodes 0/0" in status.stdout
        refused = fedmq("status", url)
        assert refused.returncode == 2 and "wants a token: give --token-file" in refused.stderr
        # the watcher first, its first state read before any node starts: it then sees the run begin (five
        # rounds of several 50 ms polls each), however fast the nodes start and train
        watch = [
            sys.executable,
            "-m",
            "fedmq",
            "status",
            url,
            "--token-file",
            str(token_file),
            "--watch",
            "0.05",
            "--json",
        ]
        watcher = subprocess.Popen(watch, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert watcher.stdout is not None
        lines = []
        while not lines or lines[-1] not in ("}\n", ""):  # its first JSON state, or its end
            lines.append(watcher.stdout.readline())
        first = "".join(lines)
        assert lines[-1] == "}\n", (first, watcher.communicate(timeout=30))
        assert json.loads(first)["status"]["state"] == "waiting"
        fed.start_nodes("node-000", "node-001", "node-002", "node-003")
        rest, errors = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, errors
        # it follows the run to its end: the last state it printed, or the coordinator's exit, which ends it too
        last = json.loads("{" + (first + rest).rsplit("\n{", 1)[-1])
        ended = last["status"]["state"] == "finished" and len(last["rounds"]) == 5
        assert ended or "stopped answering: the coordinator has exited" in errors
        assert rest.count('"state": "running"') >= 1
    finally:
        assert fed.wait() == 0, fed.log("coordinator.log")
    gone = fedmq("status", url)
    assert gone.returncode == 3 and "no answer from" in gone.stderr


def test_bad_http_options_exit_2_with_the_reason(tmp_path: Path) -> None:
    common = [
        "coordinator",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--config",
        str(ROOT / "experiments" / "quickstart.yaml"),
    ]
    bad_port = fedmq(*common, "--http", "127.0.0.1:99999")
    assert bad_port.returncode == 2 and "give PORT or HOST:PORT" in bad_port.stderr
    short = tmp_path / "short"
    short.write_text("abc")
    weak = fedmq(*common, "--out", str(tmp_path / "o"), "--http", "0", "--http-token-file", str(short))
    assert weak.returncode == 2 and "shorter than 16 characters" in weak.stderr and "Traceback" not in weak.stderr


async def test_the_dashboard_shows_the_nodes_and_a_growing_curve_in_a_browser(
    tmp_path: Path, embedded_broker: str
) -> None:
    """Also the privacy spent, for a federation with central DP (issue 32): the epsilon of the last line."""
    chromium = require_chromium()
    rounds = 6
    private = {"mechanism": "central", "noise_multiplier": 0.1, "clip_norm": 5.0}
    fed = Federation(tmp_path, embedded_broker, base_config(rounds=rounds, nodes=8, privacy=private))
    fed.start_coordinator("--http", "127.0.0.1:0")
    try:
        url = await api_url(fed)
        async with Browser(chromium, tmp_path / "chromium") as browser:
            await browser.goto(url)
            await browser.wait_for("document.body.dataset.state === 'waiting'")
            await browser.evaluate("window.__sameLoad = true")
            assert await browser.evaluate("document.body.dataset.records") == "0"
            # the page starts "disconnected" (truthy): wait for the event stream to open, not for any text
            assert await browser.wait_for("document.getElementById('conn').textContent === 'live'")
            fed.start_nodes(*(f"node-00{i}" for i in range(8)))
            # the page hears of the nodes and of each round over the stream, without reloading
            seen = []
            async with asyncio.timeout(180):
                while (points := int(await browser.evaluate("document.body.dataset.accuracyPoints || 0"))) < rounds:
                    if not seen or seen[-1] != points:
                        seen.append(points)
                    await asyncio.sleep(0.1)
            seen.append(points)
            await browser.wait_for("document.body.dataset.state === 'finished'")
            assert await browser.evaluate("window.__sameLoad") is True
            assert seen[0] == 0 and seen[-1] == rounds and seen == sorted(seen)
            assert await browser.evaluate("document.querySelectorAll('#curve-accuracy circle.point').length") == rounds
            rows = await browser.evaluate(
                "[...document.querySelectorAll('#nodes tr[data-node]')].map(r => r.dataset.node)"
            )
            assert rows == [f"node-00{i}" for i in range(8)]
            # every selected node's task is painted once a round in the participation map
            painted = int(await browser.evaluate("document.getElementById('participation').dataset.cells"))
            assert painted >= rounds * 8
            accepted = await browser.evaluate(
                "Object.fromEntries([...document.querySelectorAll('#nodes tr[data-node]')]"
                ".map(r => [r.dataset.node, +r.dataset.accepted]))"
            )
            epsilon = await browser.evaluate("document.getElementById('epsilon').textContent")
            await browser.screenshot(ARTIFACTS / "dashboard.png")
    finally:
        code = await asyncio.to_thread(fed.wait)
    assert code == 0, fed.log("coordinator.log")
    # the table's participation is the record's at the end, as the coordinator wrote it
    assert accepted == {node: entry["count"] for node, entry in fed.participation().items()}
    accuracies = [r["accuracy"] for r in fed.metrics()]
    assert len(accuracies) == rounds
    spent = fed.metrics()[-1]["dp_epsilon"]
    assert float(epsilon) == pytest.approx(spent, rel=1e-3) and fed.summary()["privacy"]["epsilon"] == spent


def fedmq(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedmq", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
