"""The coordinator's HTTP API and live dashboard (aiohttp), off unless `--http` is given.

Read-only views of the running daemon: its status, the nodes (registry and live state), the
participation record, the metrics lines, the experiment's config, KDIA's teacher weights when the
method writes them; a server-sent-event stream of what changes; `/healthz` and `/readyz` for
supervisors; `/metrics` when a Prometheus registry is attached; and the dashboard page at `/`.

It runs on the coordinator's event loop and reads the daemon between two events, so it never sees a
half-applied one, and it never holds the engine up: a stream client too slow to keep up is cut off
(its browser reconnects and reloads the state) instead of buffering without bound.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from fedmq.broker.config import is_loopback
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.storage.run_dir import read_jsonl
from fedmq.fedcore.protocol import RunState

logger = logging.getLogger(__name__)

STREAM_QUEUE = 2000
"""Events one stream client may fall behind by before it is cut off."""
TEACHER_LOG = "teacher_weights.jsonl"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
"""Answered without the token: a supervisor's probes carry none."""


TOKEN_COOKIE = "fedmq_token"
"""The dashboard's credentials: HttpOnly, so the page's scripts cannot read them."""


def _unauthorised() -> web.Response:
    error = "a bearer token is required: the Authorization header, or open the dashboard once as /?token=TOKEN"
    return web.json_response({"error": error}, status=401)


def page_security_headers(page: str) -> dict[str, str]:
    """A Content-Security-Policy that lets run only the page's own inline scripts (by their hash):
    no injected script, handler attribute or foreign source runs, and the page talks to this
    server only. Styles may be inline (the legends colour their swatches), never scripts."""
    hashes = " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"
        for body in re.findall(r"<script>(.*?)</script>", page, flags=re.DOTALL)
    )
    policy = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:;"
        " base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
    }


def parse_address(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[V6]:PORT`; a bare port listens on loopback only."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise CoordinatorError(f"--http {text!r}: give PORT or HOST:PORT, with a port from 0 to 65535")
    return host, int(port)


def read_token(path: Path) -> str:
    """The bearer token from its file (first line); refused when empty, so no one runs 'protected' by ''."""
    try:
        lines = path.read_text().strip().splitlines()
    except OSError as exc:
        raise CoordinatorError(f"cannot read the HTTP token file {path}: {exc.strerror}") from exc
    token = lines[0].strip() if lines else ""
    if len(token) < 16:
        raise CoordinatorError(f"the HTTP token in {path} is shorter than 16 characters: use a long random one")
    return token


@dataclass(slots=True)
class NodeLive:
    """What the API sees of one node beyond the registry and the record: its updates as they arrive."""

    updates: int = 0
    bytes_in: int = 0
    last_update_at: float | None = None
    """Unix time of its last update's arrival."""
    staleness: int | None = None
    """Model versions the coordinator had moved on between the node's task and its last update."""
    task_version: int | None = None
    """The model version its latest task trained from."""


class LiveState:
    """The watcher half: records what the coordinator's events say, and fans them out to stream clients."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.records: list[dict[str, Any]] = []
        self.nodes: dict[str, NodeLive] = {}
        self.clients: set[asyncio.Queue[tuple[str, Any] | None]] = set()
        self.cut_off = 0
        coordinator.watchers.append(self)

    def __call__(self, now: float, event: e.Event, commands: list[c.Command]) -> None:
        if isinstance(event, e.Start):  # a resumed run's earlier lines (the daemon has truncated them by now)
            self.records = read_jsonl(self.coordinator.run_dir.root / "metrics.jsonl")
        elif isinstance(event, e.NodeSeen):
            self.publish("node", {"node": event.node, "online": event.online, "num_samples": event.num_samples})
        elif isinstance(event, e.UpdateArrived):
            self._update(event)
        for command in commands:
            if isinstance(command, c.Configure):
                for task in command.tasks:
                    self.nodes.setdefault(task.node, NodeLive()).task_version = task.version
            elif isinstance(command, c.Record):
                record = dict(command.record)
                self.records.append(record)
                self.publish("record", record)
                self.publish("participation", self._participation_of(record))
            elif isinstance(command, c.PublishStatus):
                self.publish("status", status_view(self.coordinator))

    def _participation_of(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The record of each node the metrics line names (selected, accepted, late, ...): what changed."""
        named = {n for value in record.values() if isinstance(value, list) for n in value if isinstance(n, str)}
        out = {}
        for node in sorted(named):
            entry = self.coordinator.participation.get(node)
            if entry is not None:
                out[node] = entry.to_json()
        return out

    def _update(self, event: e.UpdateArrived) -> None:
        message = event.message
        live = self.nodes.setdefault(message.sender, NodeLive())
        live.updates += 1
        live.bytes_in += message.nbytes
        live.last_update_at = time.time()
        if live.task_version is not None:
            live.staleness = max(self.coordinator.engine.version - live.task_version, 0)
        self.publish("update", {"node": message.sender, "round": message.round, **asdict(live)})

    def publish(self, kind: str, data: Any) -> None:
        for queue in list(self.clients):
            try:
                queue.put_nowait((kind, data))
            except asyncio.QueueFull:  # too slow: cut off, it reconnects and reloads the state
                self.clients.discard(queue)
                self.cut_off += 1
                queue.get_nowait()
                queue.put_nowait(None)

    def close(self) -> None:
        """The run ended: every stream says so and ends."""
        self.publish("end", status_view(self.coordinator))
        for queue in list(self.clients):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)
        self.clients.clear()


def status_view(coordinator: Coordinator) -> dict[str, Any]:
    config = coordinator.config
    return {
        "state": coordinator.state,
        "connected": coordinator.connected.is_set(),
        "federation": config.federation,
        "method": config.method,
        "engine": config.engine,
        "run_id": coordinator.run_id,
        "model_version": coordinator.engine.version,
        "nodes_known": len(coordinator.registry),
        "nodes_live": len(coordinator.registry.live_ids()),
        "uptime_s": round(coordinator.uptime_s, 3),
        **coordinator.engine.status().fields,
    }


def nodes_view(coordinator: Coordinator, live: Mapping[str, NodeLive]) -> list[dict[str, Any]]:
    out = []
    for info in coordinator.registry.all():
        record = coordinator.participation.get(info.node_id)
        out.append(
            {
                "node_id": info.node_id,
                "online": info.online,
                "device": info.device,
                "num_samples": info.num_samples,
                "participation": record.to_json() if record is not None else None,
                "live": asdict(live.get(info.node_id, NodeLive())),
            }
        )
    return out


class TeacherTail:
    """KDIA's latest teacher weights, read incrementally from the log the method writes in the run
    directory (only the bytes added since the last call, whatever the log's length)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""
        self.round = -1
        self.weights: list[dict[str, Any]] = []

    def latest(self) -> dict[str, Any]:
        try:
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read()
        except FileNotFoundError:
            return {"round": None, "weights": []}
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        for line in lines:
            try:
                record = json.loads(line)
                round_ = int(record["round"])
            except (ValueError, KeyError, TypeError):
                continue
            if round_ != self.round:
                self.round, self.weights = round_, []
            self.weights.append(record)
        return {"round": self.round if self.weights else None, "weights": self.weights}


class CoordinatorAPI:
    def __init__(
        self,
        coordinator: Coordinator,
        *,
        config: Mapping[str, Any] | None = None,
        token: str | None = None,
        metrics: Callable[[], tuple[bytes, str]] | None = None,
        heartbeat_s: float = 15.0,
    ) -> None:
        self.coordinator = coordinator
        self.config = dict(config or {})
        self.token = token
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.live = LiveState(coordinator)
        self.teacher = TeacherTail(coordinator.run_dir.root / TEACHER_LOG)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.add_routes(
            [
                web.get("/", self._dashboard),
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/api/status", self._status),
                web.get("/api/nodes", self._nodes),
                web.get("/api/participation", self._participation),
                web.get("/api/rounds", self._rounds),
                web.get("/api/config", self._config),
                web.get("/api/teacher", self._teacher),
                web.get("/api/events", self._events),
                web.get("/metrics", self._metrics),
            ]
        )
        return app

    async def start(self, host: str, port: int) -> str:
        """Listen; returns the base URL (with the port the system chose for port 0)."""
        if not is_loopback(host) and self.token is None:
            logger.warning("the HTTP API listens on %s without a token: anyone who reaches it reads the run", host)
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise CoordinatorError(f"the HTTP API cannot listen on {host}:{port}: {exc.strerror}") from exc
        bound = self._runner.addresses[0][1]  # the port the system chose for port 0
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound}/"
        self.coordinator.run_dir.write_json("http.json", {"url": self.url, "token_required": self.token is not None})
        logger.info("HTTP API and dashboard on %s", self.url)
        return self.url

    async def stop(self) -> None:
        self.live.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers --------------------------------------------------------------------------

    @web.middleware
    async def _auth(self, request: web.Request, handler: Callable[[web.Request], Any]) -> web.StreamResponse:
        """The token from the Authorization header (API clients) or the dashboard's HttpOnly cookie.
        A browser opens ``/?token=TOKEN`` once: the token moves into the cookie and out of the URL,
        so no script on the page (the dashboard's, or one slipped in by a node) can read it."""
        if self.token is None or request.path in PUBLIC_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        if header is not None:
            scheme, _, given = header.partition(" ")
            if scheme != "Bearer" or not given or not (given.isascii() and given.isprintable()):
                error = "malformed Authorization header: send `Authorization: Bearer TOKEN`"
                return web.json_response({"error": error}, status=400)
        elif request.path == "/" and "token" in request.query:
            if not self._is_token(request.query["token"]):
                return _unauthorised()
            moved = web.Response(status=303, headers={"Location": "/", "Cache-Control": "no-store"})
            moved.set_cookie(
                TOKEN_COOKIE, self.token, httponly=True, samesite="Strict", path="/", secure=request.secure
            )
            return moved
        else:
            given = request.cookies.get(TOKEN_COOKIE, "")
        if not self._is_token(given):
            return _unauthorised()
        return await handler(request)

    def _is_token(self, given: str) -> bool:
        assert self.token is not None
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), self.token.encode())

    async def _dashboard(self, _: web.Request) -> web.Response:
        page = resources.files("fedmq.coordinator.observers").joinpath("dashboard.html").read_text()
        headers = {"Cache-Control": "no-store", **page_security_headers(page)}
        return web.Response(text=page, content_type="text/html", headers=headers)

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _readyz(self, _: web.Request) -> web.Response:
        ready = self.coordinator.connected.is_set() and self.coordinator.state not in (
            RunState.FAILED,
            RunState.STOPPED,
        )
        return web.json_response({"ready": ready, "state": self.coordinator.state}, status=200 if ready else 503)

    async def _status(self, _: web.Request) -> web.Response:
        return web.json_response(status_view(self.coordinator))

    async def _nodes(self, _: web.Request) -> web.Response:
        return web.json_response(nodes_view(self.coordinator, self.live.nodes))

    async def _participation(self, _: web.Request) -> web.Response:
        return web.json_response(self.coordinator.participation.to_json())

    async def _rounds(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return web.json_response({"error": "since must be an integer index"}, status=400)
        records = self.live.records
        return web.json_response({"since": since, "total": len(records), "records": records[max(since, 0) :]})

    async def _config(self, _: web.Request) -> web.Response:
        return web.json_response(self.config)

    async def _teacher(self, _: web.Request) -> web.Response:
        return web.json_response(self.teacher.latest())

    async def _metrics(self, _: web.Request) -> web.Response:
        if self.metrics is None:
            return web.json_response({"error": "no metrics registry is attached"}, status=404)
        body, content_type = self.metrics()
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: `status`, `record` (a metrics line), `participation` (the records of the
        nodes it names), `node` (one came or went), `update` (one arrived), and `end` when the run is over."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )
        await response.prepare(request)
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue(STREAM_QUEUE)
        self.live.clients.add(queue)
        try:
            await response.write(_sse("status", status_view(self.coordinator)))
            while True:
                try:
                    async with asyncio.timeout(self.heartbeat_s):
                        item = await queue.get()
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if item is None:
                    break
                await response.write(_sse(*item))
        except ConnectionResetError:
            pass  # the client left
        finally:
            self.live.clients.discard(queue)
        return response


def _sse(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), default=str)}\n\n".encode()
