"""`fedmq status URL`: what the dashboard shows, in the terminal, from a coordinator's HTTP API."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedmq.broker.errors import BusError
from fedmq.fedcore.errors import ConfigError


class Unreachable(BusError):
    """The API did not answer: exit 3, like an unreachable broker."""


def resolve_url(target: str) -> str:
    """A URL as given, or a run directory's `http.json` (written by `--http`)."""
    if target.startswith(("http://", "https://")):
        return target if target.endswith("/") else target + "/"
    path = Path(target)
    info = path / "http.json" if path.is_dir() else path
    try:
        return str(json.loads(info.read_text())["url"])
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(
            f"{target} is neither a URL nor a run directory with http.json (start the coordinator with --http)"
        ) from exc


def fetch(url: str, path: str, token: str | None, timeout: float = 10.0) -> Any:
    request = urllib.request.Request(url + path.lstrip("/"))
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise ConfigError(f"{url} wants a token: give --token-file") from exc
        raise ConfigError(f"{url}{path.lstrip('/')}: HTTP {exc.code}") from exc
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        raise Unreachable(f"no answer from {url}: {getattr(exc, 'reason', exc)}") from exc


def snapshot(url: str, token: str | None) -> dict[str, Any]:
    return {
        "status": fetch(url, "api/status", token),
        "nodes": fetch(url, "api/nodes", token),
        "rounds": fetch(url, "api/rounds", token)["records"],
    }


def render(state: dict[str, Any], console: Console, last: int = 10) -> None:
    status, nodes, rounds = state["status"], state["nodes"], state["rounds"]
    step = "version" if status.get("engine") == "async" else "round"
    where = status.get("model_version") if step == "version" else f"{status.get('round')}/{status.get('rounds')}"
    accuracy = status.get("accuracy")
    line = (
        f"[bold]{status.get('federation')}[/] {status.get('method')} ({status.get('engine')}): "
        f"[bold]{status.get('state')}[/], {step} {where}, live nodes {status.get('nodes_live')}/"
        f"{status.get('nodes_known')}"
    )
    if accuracy is not None:
        line += f", accuracy {accuracy:.4f} (best {status.get('best_accuracy', accuracy):.4f})"
    console.print(line)
    if rounds:
        table = Table(title=f"last {min(last, len(rounds))} of {len(rounds)} {step}s", title_justify="left")
        for column in (step, "accuracy", "loss", "train loss", "accepted", "late", "lost", "seconds"):
            table.add_column(column, justify="right")
        for r in rounds[-last:]:
            accepted = r.get("accepted", r.get("folded", []))
            table.add_row(
                str(r.get("version", r.get("round"))),
                _num(r.get("accuracy")),
                _num(r.get("loss")),
                _num(r.get("train_loss")),
                str(len(accepted) if isinstance(accepted, list) else accepted),
                _count(r.get("late")),
                _count(r.get("lost")),
                _num(r.get("round_seconds"), 3),
            )
        console.print(table)
    offline = [n["node_id"] for n in nodes if not n["online"]]
    stale = sorted(((n["live"]["staleness"] or 0), n["node_id"]) for n in nodes if n["live"]["staleness"])
    line = f"{len(nodes)} nodes, {len(offline)} offline"
    if offline:
        line += f" ({', '.join(offline[:10])}{', ...' if len(offline) > 10 else ''})"
    if stale:
        line += "; stalest: " + ", ".join(f"{n} ({s} versions)" for s, n in stale[-5:][::-1])
    console.print(line)


def _num(value: Any, digits: int = 4) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.{digits}f}"


def _count(value: Any) -> str:
    if isinstance(value, list):
        return str(len(value))
    return "-" if value is None else str(value)
