"""`fedmq run`: a whole federation on this machine, each part in its own process.

A broker (the embedded one unless a URL is given), the coordinator, and a few node-host processes
(about one per core, each hosting many node daemons with their own MQTT connections). Progress comes
from the coordinator's retained status topic, pushed over MQTT like everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from broker import BusClient, BusConfig, Kind, Topics
from broker.errors import BusError
from broker.mosquitto import free_port, wait_for_port
from coordinator.run_dir import write_json
from experiments.config import ExperimentConfig, load_config

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 4, 130


@dataclass
class Children:
    """Every process the run started, so that all of them are stopped whatever happens."""

    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def start(self, name: str, args: list[str], log: Path) -> asyncio.subprocess.Process:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "experiments",
                *args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1"},
            )
        self.procs[name] = proc
        return proc

    async def stop(self, names: list[str] | None = None, *, grace_s: float = 10.0) -> None:
        procs = [p for n, p in self.procs.items() if (names is None or n in names) and p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace_s)
        except TimeoutError:
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await asyncio.gather(*(p.wait() for p in procs))


def default_out(cfg: ExperimentConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def git_revision() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
            check=False,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def split_evenly(items: list[str], parts: int) -> list[list[str]]:
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def run_from_cli(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    out = args.out or default_out(cfg)
    processes = args.processes or cfg.hosting.processes or os.cpu_count() or 1
    return asyncio.run(
        run_federation(
            cfg,
            out,
            broker=args.broker,
            processes=processes,
            quiet=args.quiet,
            timeout_s=args.timeout,
            verbose=args.verbose,
        )
    )


async def run_federation(
    cfg: ExperimentConfig,
    out: Path,
    *,
    broker: str | None = None,
    processes: int = 2,
    quiet: bool = False,
    timeout_s: float | None = None,
    verbose: int = 0,
) -> int:
    console = Console(stderr=False, highlight=False)
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (start-up, before any task runs)
    logs = out / "logs"
    federation = cfg.federation or f"{cfg.name}-{os.urandom(3).hex()}"
    cfg = cfg.model_copy(update={"federation": federation})
    config_path = out / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    write_json(
        out / "run.json",
        {
            "command": sys.argv,
            "git_revision": git_revision(),
            "started": datetime.now().isoformat(timespec="seconds"),
            "federation": federation,
            "seed": cfg.seed,
            "python": sys.version.split()[0],
            "processes": processes,
        },
    )
    children = Children()
    started = time.monotonic()
    verbosity = ["-v"] * max(verbose, 1)
    try:
        if broker is None:
            port = free_port()
            broker = f"mqtt://127.0.0.1:{port}"
            proc = await children.start("broker", ["broker", "--embedded", "--port", str(port)], logs / "broker.log")
            await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 20.0)
            if proc.returncode is not None:
                raise BusError("the embedded broker exited at start; see logs/broker.log")
            where = f"embedded broker on {broker}"
        else:
            where = f"broker {broker}"
        if not quiet:
            console.print(
                f"[bold]fedmq run[/] {cfg.name}: {cfg.nodes} nodes in {min(processes, cfg.nodes)} processes,"
                f" C={cfg.fraction}, {cfg.rounds} rounds, {cfg.method.name} on {cfg.data.dataset}; {where}"
            )
            console.print(f"run directory: {out}")
        common = ["--config", str(config_path), "--federation", federation, *verbosity]
        threads = ["--threads", str(cfg.hosting.threads_per_process)]
        coordinator = await children.start(
            "coordinator",
            [
                "coordinator",
                "--broker",
                broker,
                "--out",
                str(out),
                *common,
                *threads,
                "--log-file",
                str(logs / "coordinator.log"),
            ],
            logs / "coordinator.out",
        )
        for i, group in enumerate(split_evenly(cfg.node_ids(), processes)):
            ids = [arg for node in group for arg in ("--node-id", node)]
            await children.start(
                f"nodes-{i}",
                [
                    "node",
                    "--broker",
                    broker,
                    *ids,
                    *common,
                    *threads,
                    "--exit-when-done",
                    "--log-file",
                    str(logs / f"nodes-{i}.log"),
                ],
                logs / f"nodes-{i}.out",
            )
        monitor = asyncio.create_task(_monitor(cfg, broker, federation, console, quiet))
        try:
            await asyncio.wait_for(coordinator.wait(), timeout_s)
        except TimeoutError:
            console.print(f"[red]stopping: --timeout of {timeout_s:g} s reached[/]")
            await children.stop(["coordinator"], grace_s=15)
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await monitor
        node_names = [n for n in children.procs if n.startswith("nodes-")]
        try:
            await asyncio.wait_for(asyncio.gather(*(children.procs[n].wait() for n in node_names)), 15)
        except TimeoutError:
            await children.stop(node_names)
    except asyncio.CancelledError:
        return EXIT_INTERRUPTED
    finally:
        await asyncio.shield(children.stop())
    return _report(out, console, coordinator.returncode, time.monotonic() - started, quiet)


async def _monitor(cfg: ExperimentConfig, url: str, federation: str, console: Console, quiet: bool) -> None:
    """Follow the coordinator's status topic: a progress bar on a terminal, a line per round otherwise."""
    topics = Topics(federation)
    bus_config = BusConfig.from_url(url, protocol=cfg.bus.protocol, persistent_session=False)
    client = BusClient(bus_config, client_id=f"{federation}-monitor-{os.getpid()}", federation=federation)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        disable=quiet or not console.is_terminal,
    )
    async with client as bus:
        await bus.subscribe(topics.coordinator_status)
        with progress:
            task = progress.add_task("rounds", total=cfg.rounds, status="waiting for nodes")
            async for envelope in bus.messages():
                if envelope.message.kind != Kind.COORDINATOR_STATUS:
                    continue
                meta: dict[str, Any] = dict(envelope.message.meta)
                done = int(meta.get("round_done", -1)) + 1
                accuracy = meta.get("accuracy")
                status = f"live {meta.get('live_nodes', 0)}" + (f"  acc {accuracy:.4f}" if accuracy is not None else "")
                progress.update(task, completed=done, status=status)
                if not quiet and not console.is_terminal and "round_done" in meta:
                    console.print(f"round {done}/{cfg.rounds} {status}")


def _report(out: Path, console: Console, returncode: int | None, wall: float, quiet: bool) -> int:
    summary_path = out / "summary.json"
    if not summary_path.exists():
        console.print(f"[red]the coordinator wrote no summary (exit code {returncode}); see {out / 'logs'}[/]")
        return EXIT_FAILED
    summary = json.loads(summary_path.read_text())
    final, best = summary.get("final_accuracy"), summary.get("best_accuracy")
    if summary.get("state") != "finished" or returncode != 0:
        console.print(
            f"[red]run {summary.get('state')} after {summary.get('rounds_completed')} rounds; see {out / 'logs'}[/]"
        )
        return EXIT_FAILED
    totals = summary.get("participation_totals", {})
    rejected = summary.get("bus", {}).get("rejected", {})
    console.print(
        f"[bold green]final accuracy {final:.4f}[/] (best {best:.4f}) after {summary['rounds_completed']} rounds,"
        f" {wall:.1f} s wall; updates accepted {totals.get('accepted')}, late {totals.get('late')},"
        f" lost {totals.get('lost')}" + (f"; rejected messages {rejected}" if rejected else "")
    )
    console.print(f"results: {out}/summary.json, metrics.jsonl, participation.json")
    return EXIT_OK
