"""The dashboard runs no one's HTML and keeps its token from the page's scripts (issue 31, item 8), in
a real headless browser (Debian's chromium) against the coordinator's real HTTP API.

A node id carrying HTML once reached the node table unescaped and its script read the token from
the page's URL (`?token=`). Node ids are now bounded where they enter (topics), so here the hostile
node is written into the coordinator's registry directly: this tests the page's own defences, which
must hold whatever a future channel lets through."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import aiohttp
import pytest

from fedmq.broker import BusConfig
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.observers.http import TOKEN_COOKIE, CoordinatorAPI
from tests.browser import Browser, require_chromium
from tests.coordinator.engine_helpers import config
from tests.coordinator.test_payloads import PerNode, _model

pytestmark = pytest.mark.slow
TOKEN = "s3cret-token-for-the-test-0123456789"
HOSTILE = '<img src=x onerror="window.__pwned = document.cookie + location.href">'


@pytest.fixture
async def api(tmp_path: Path) -> CoordinatorAPI:
    cfg = dataclasses.replace(config(), out_dir=tmp_path)
    coordinator = Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), PerNode(None, model=_model()))
    coordinator.registry.apply_status(HOSTILE, {"state": "online", "num_samples": 7})
    coordinator.registry.apply_status("node-000", {"state": "online", "num_samples": 5})
    server = CoordinatorAPI(coordinator, token=TOKEN)
    await server.start("127.0.0.1", 0)
    yield server
    await server.stop()


async def test_a_node_id_carrying_html_is_shown_as_text_and_no_script_sees_the_token(
    api: CoordinatorAPI, tmp_path: Path
) -> None:
    chromium = require_chromium()
    assert api.url is not None
    async with Browser(chromium, tmp_path / "chromium") as browser:
        await browser.goto(f"{api.url}?token={TOKEN}")
        rows = "[...document.querySelectorAll('#nodes tr[data-node]')].map(r => r.dataset.node)"
        await browser.wait_for(f"{rows}.length === 2")
        assert await browser.evaluate(rows) == [HOSTILE, "node-000"]  # the id, as text
        assert await browser.evaluate("document.querySelectorAll('#nodes img').length") == 0
        assert await browser.evaluate("window.__pwned === undefined") is True
        # the token left the URL for an HttpOnly cookie: the page's scripts cannot read it
        assert await browser.evaluate("location.href") == api.url
        assert TOKEN not in await browser.evaluate("document.cookie + location.href + document.body.innerHTML")
        # the API still answers the page (the browser sends the cookie), and the stream is live
        # the page starts "disconnected" (truthy): wait for the event stream to open, not for any text
        assert await browser.wait_for("document.getElementById('conn').textContent === 'live'")
        # a script slipped into the page by other means does not run: the policy allows only the page's own
        await browser.evaluate(
            "const s = document.createElement('script'); s.textContent = 'window.__injected = 1';"
            " document.body.appendChild(s); 0"
        )
        assert await browser.evaluate("window.__injected === undefined") is True


async def test_the_token_travels_in_a_header_or_an_httponly_cookie_and_bad_headers_are_400(
    api: CoordinatorAPI,
) -> None:
    url = api.url
    assert url is not None
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "api/status") as response:
            assert response.status == 401 and "?token=TOKEN" in (await response.json())["error"]
        async with session.get(url + f"api/status?token={TOKEN}") as response:
            assert response.status == 401  # a token in an API URL is not taken: it would end up in logs
        async with session.get(url + "?token=wrong-token-0123456789", allow_redirects=False) as response:
            assert response.status == 401
        async with session.get(url + f"?token={TOKEN}", allow_redirects=False) as response:
            assert response.status == 303 and response.headers["Location"] == "/"
            cookie = response.cookies[TOKEN_COOKIE]
            assert cookie.value == TOKEN and cookie["httponly"] and cookie["samesite"] == "Strict"
        with_cookie = {"Cookie": f"{TOKEN_COOKIE}={TOKEN}"}
        async with session.get(url, headers=with_cookie) as response:
            assert response.status == 200
            policy = response.headers["Content-Security-Policy"]
            directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
            assert directives["default-src"] == "'none'" and directives["connect-src"] == "'self'"
            assert directives["script-src"].startswith("'sha256-") and "unsafe" not in directives["script-src"]
            assert response.headers["X-Content-Type-Options"] == "nosniff"
        async with session.get(url + "api/nodes", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 200 and {n["node_id"] for n in await response.json()} == {HOSTILE, "node-000"}
        for header in ["Basic abc", "Bearer", "Bearer tök-en", "Bearer a\tb", TOKEN]:
            async with session.get(url + "api/status", headers={"Authorization": header}) as response:
                assert response.status == 400, header
                assert "malformed Authorization header" in (await response.json())["error"]
