"""A real headless browser for the dashboard's tests: Debian's chromium, driven over the DevTools
protocol with aiohttp's WebSocket client (no Selenium or Playwright to install)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def require_chromium() -> str:
    """The browser's path; the test is skipped without one, or fails where FEDMQ_REQUIRE_BROWSER says it must run."""
    import pytest

    chromium = find_chromium()
    if chromium is None:
        if os.environ.get("FEDMQ_REQUIRE_BROWSER"):
            pytest.fail("FEDMQ_REQUIRE_BROWSER is set but chromium is not installed")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return chromium


class Browser:
    """One headless page. `evaluate` runs JavaScript in it and returns the value."""

    def __init__(self, binary: str, profile: Path, *, width: int = 1400, height: int = 1100) -> None:
        self.binary, self.profile, self.size = binary, profile, (width, height)
        self._proc: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Browser:
        self.profile.mkdir(parents=True, exist_ok=True)
        args = [
            self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
            f"--window-size={self.size[0]},{self.size[1]}", "about:blank",
        ]  # fmt: skip
        self._proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        async with asyncio.timeout(60):
            while not (port := await asyncio.to_thread(_devtools_port, self.profile)):
                if self._proc.returncode is not None:
                    raise RuntimeError(f"chromium exited with {self._proc.returncode} at start")
                await asyncio.sleep(0.1)
        self._session = aiohttp.ClientSession()
        async with self._session.get(f"http://127.0.0.1:{port}/json/list") as response:
            pages = [t for t in await response.json() if t["type"] == "page"]
        self._ws = await self._session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        self._reader = asyncio.create_task(self._read())
        await self.call("Page.enable")
        await self.call("Runtime.enable")
        return self

    async def __aexit__(self, *_: Any) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await self._proc.wait()
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()

    async def _read(self) -> None:
        assert self._ws is not None
        async for frame in self._ws:
            data = json.loads(frame.data)
            future = self._pending.pop(data.get("id", -1), None)
            if future is not None and not future.done():
                future.set_result(data)
            elif "method" in data:
                self._events.put_nowait(data)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self._ws is not None
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        async with asyncio.timeout(30):
            reply = await future
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def goto(self, url: str) -> None:
        while not self._events.empty():
            self._events.get_nowait()
        await self.call("Page.navigate", url=url)
        async with asyncio.timeout(30):
            while (await self._events.get()).get("method") != "Page.loadEventFired":
                pass

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll `expression` until it is truthy; returns its value."""
        async with asyncio.timeout(timeout):
            while not (value := await self.evaluate(expression)):
                await asyncio.sleep(0.2)
        return value

    async def screenshot(self, path: Path) -> None:
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(_write, path, base64.b64decode(shot["data"]))


def _devtools_port(profile: Path) -> int | None:
    """The port chromium chose, once it has written it into its profile."""
    try:
        text = (profile / "DevToolsActivePort").read_text().split()
    except FileNotFoundError:
        return None
    return int(text[0]) if text else None


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
