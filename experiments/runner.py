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
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from fedmq.broker import BusClient, BusConfig, Kind, Topics
from fedmq.broker.errors import BusError
from fedmq.broker.servers.credentials import COORDINATOR, MONITOR, Access
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, wait_for_port
from fedmq.broker.servers.provision import Provisioned, provision
from fedmq.coordinator.storage.run_dir import write_json, write_text
from fedmq.experiments.broker_flags import access_flags, broker_access
from fedmq.experiments.build import bus_config, federation_id, preflight, site_federation
from fedmq.experiments.cli.exits import EXIT_BUS, EXIT_CONFIG, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from fedmq.experiments.config import ExperimentConfig, split_evenly
from fedmq.experiments.grid import Grid, cell_is_done, load_experiment
from fedmq.experiments.report import write_report
from fedmq.experiments.secure_defaults import secure_aggregator
from fedmq.experiments.service import PARENT_ENV, wait_for_broker
from fedmq.fedcore.errors import ConfigError

CONNECT_TIMEOUT_S = 10.0
"""How long `fedmq run --broker URL` waits for that broker (the daemons' default --connect-timeout)."""


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
                "fedmq",
                *args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=os.environ | {"PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid())},
            )
        self.procs[name] = proc
        return proc

    async def stop(self, names: list[str] | None = None, *, grace_s: float = 10.0) -> None:
        """SIGINT, as Ctrl-C: a run being stopped has nothing to drain for (SIGTERM would have the nodes
        finish their updates, for a broker stopped with them), and the coordinator still writes its summary."""
        procs = [p for n, p in self.procs.items() if (names is None or n in names) and p.returncode is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
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


async def run_from_cli(args: argparse.Namespace) -> int:
    grid = load_experiment(args.config, args.overrides)
    first = grid.cells[0].config
    out = args.out or default_out(first)
    processes = args.processes or first.hosting.processes or os.cpu_count() or 1
    if args.secure and args.broker:
        raise ConfigError(
            "--secure starts a broker of its own; for yours, give --broker mqtts://HOST:PORT with --credentials"
        )
    options = {
        "broker": args.broker,
        "processes": processes,
        "quiet": args.quiet,
        "verbose": args.verbose,
        "secure": args.secure,
        "access": access_flags(args),
        "monitor_access": broker_access(args),
        "coordinator_flags": coordinator_flags(args),
    }
    if grid.is_grid:
        return await run_grid(grid, out, timeout_s=args.timeout, **options)
    code = await run_federation(first, out, timeout_s=args.timeout, **options)
    if (out / "summary.json").exists():
        _write_report(out, Console(highlight=False), args.quiet)
    return code


def coordinator_flags(args: argparse.Namespace) -> list[str]:
    """`fedmq run`'s options that only the coordinator process takes (the HTTP API)."""
    flags = []
    if args.http is not None:
        host, port = args.http
        flags += ["--http", f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if args.http_token_file is not None:
        flags += ["--http-token-file", str(args.http_token_file)]
    if args.tensorboard:
        from fedmq.coordinator.observers.tensorboard import check_installed

        check_installed()  # before starting anything: exit 2 saying what to install
        flags.append("--tensorboard")  # into each run directory's tensorboard/
    return flags


def _write_report(out: Path, console: Console, quiet: bool) -> None:
    try:
        path = write_report(out)
    except (OSError, ValueError, KeyError) as exc:
        console.print(f"[yellow]could not write the report: {exc}[/]")
        return
    if not quiet:
        console.print(f"report: {path}")


async def run_grid(
    grid: Grid,
    out: Path,
    *,
    broker: str | None,
    processes: int,
    quiet: bool,
    timeout_s: float | None,
    verbose: int,
    secure: bool = False,
    access: list[str] | None = None,
    monitor_access: Access | None = None,
    coordinator_flags: list[str] | None = None,
) -> int:
    """Every cell of the grid, one federation after another; finished cells are kept (resumable)."""
    console = Console(highlight=False)
    for cell in grid.cells:  # a bad cell fails now, not hours into the grid
        await asyncio.to_thread(preflight, cell.config)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    write_json(out / "grid.json", grid.describe())
    total = len(grid.cells)
    failed: list[str] = []
    ran: list[str] = []
    started = time.monotonic()
    for n, cell in enumerate(grid.cells, 1):
        directory = out / "cells" / cell.cell_id
        what = ", ".join(f"{k}={v}" for k, v in cell.labels.items())
        if cell_is_done(directory, cell):
            console.print(f"[dim]cell {n}/{total} ({what}): finished before, kept[/]")
            continue
        if directory.exists():
            console.print(f"[yellow]cell {n}/{total}: an unfinished or changed earlier run is replaced[/]")
            await asyncio.to_thread(shutil.rmtree, directory)
        eta = ""
        if ran:
            left = sum(1 for c in grid.cells[n - 1 :] if not cell_is_done(out / "cells" / c.cell_id, c))
            eta = f", about {left * (time.monotonic() - started) / len(ran) / 60:.1f} min left in the grid"
        console.print(f"[bold]cell {n}/{total}[/] ({what}){eta}")
        code = await run_federation(
            cell.config, directory, broker=broker, processes=processes, quiet=quiet, timeout_s=timeout_s,
            verbose=verbose, secure=secure, access=access, monitor_access=monitor_access,
            coordinator_flags=coordinator_flags,
        )  # fmt: skip
        ran.append(cell.cell_id)
        if code == EXIT_INTERRUPTED:
            console.print("[yellow]interrupted; run the same command again to resume the grid[/]")
            return code
        if code != EXIT_OK:
            failed.append(cell.cell_id)
    _write_report(out, console, quiet)
    if failed:
        console.print(f"[red]{len(failed)} cell(s) failed: {', '.join(failed)}; run again to retry them[/]")
        return EXIT_FAILED
    return EXIT_OK


async def run_federation(
    cfg: ExperimentConfig,
    out: Path,
    *,
    broker: str | None = None,
    processes: int = 2,
    quiet: bool = False,
    timeout_s: float | None = None,
    verbose: int = 0,
    secure: bool = False,
    access: list[str] | None = None,
    monitor_access: Access | None = None,
    coordinator_flags: list[str] | None = None,
    console: Console | None = None,
) -> int:
    """One federation: a broker unless `broker` is given (with `secure`, provisioned into OUT/secure and
    TLS only), the coordinator and the node hosts as processes; `access` are the broker-access flags
    the processes get, `monitor_access` what they say for the progress monitor in this process."""
    console = console or Console(stderr=False, highlight=False)
    await asyncio.to_thread(preflight, cfg)
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (start-up, before any task runs)
    logs = out / "logs"
    # a broker with credentials was provisioned for the config's federation id (its ACL names the
    # topics), so only an anonymous run gets a fresh id that keeps it apart from earlier runs' retained state
    federation = cfg.federation or (federation_id(cfg) if access else f"{cfg.name}-{os.urandom(3).hex()}")
    cfg = cfg.model_copy(update={"federation": federation})
    averaging = None
    if secure:  # before config.yaml: the coordinator reads its rule there
        cfg, averaging = secure_aggregator(cfg)
    for site in cfg.hierarchy.site_names():  # a site's federation id too long for a topic level: exit 2 now
        site_federation(federation, site)
    config_path = out / "config.yaml"
    write_text(config_path, cfg.to_yaml())
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
    access = list(access or [])
    monitor_access = monitor_access or Access()
    try:
        if secure:
            provisioned = await asyncio.to_thread(_provision_run, out / "secure", cfg, federation)
            broker = provisioned.url()
            access = ["--credentials", str(provisioned.credentials)]
            monitor_access = Access(source=provisioned.credentials, use_environment=False)
            kind = "mosquitto" if find_mosquitto() is not None else "embedded broker"
            command = ["broker", "--secure", str(provisioned.directory), "--log-file", str(logs / "broker.log")]
            proc = await children.start("broker", command, logs / "broker.out")
            await asyncio.to_thread(wait_for_port, "127.0.0.1", provisioned.port, 20.0)
            if proc.returncode is not None:
                raise BusError(f"the {kind} exited at start; see {logs / 'broker.out'}")
            where = f"{kind} on {broker} (TLS, a password and topic rules per node: {provisioned.directory})"
        elif broker is None:
            port = free_port()
            broker = f"mqtt://127.0.0.1:{port}"
            bridged = bool(cfg.hierarchy.sites and cfg.hierarchy.bridge)
            kind = "mosquitto" if bridged else "embedded broker"
            if bridged and find_mosquitto() is None:
                raise ConfigError(
                    "hierarchy.bridge: the site brokers are mosquitto bridges, but mosquitto is not installed"
                    " (apt-get install mosquitto), or set hierarchy.bridge: false to run every site on one broker"
                )
            command = ["broker", "--port", str(port)] + ([] if bridged else ["--embedded"])
            proc = await children.start("broker", command, logs / "broker.log")
            await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 20.0)
            if proc.returncode is not None:
                raise BusError(f"the {kind} exited at start; see logs/broker.log")
            where = f"{kind} on {broker}"
        else:  # the user's broker: unreachable is exit 3 now, before any process starts
            await wait_for_broker(bus_config(cfg, broker), CONNECT_TIMEOUT_S, flag=None)
            where = f"broker {broker}"
        if not quiet:
            hosts = f"{min(processes, cfg.nodes)} processes"
            if cfg.hierarchy.sites:
                behind = ", each with its broker bridged to the central one" if cfg.hierarchy.bridge else ""
                hosts = f"{cfg.hierarchy.sites} sites{behind}"
            console.print(
                f"[bold]fedmq run[/] {cfg.name}: {cfg.nodes} nodes in {hosts},"
                f" {_pace(cfg)}, {cfg.method.name} on {cfg.data.dataset}; {where}"
            )
            console.print(f"run directory: {out}")
            if averaging is not None:
                console.print(averaging)
            if coordinator_flags and "--http" in coordinator_flags:
                address = coordinator_flags[coordinator_flags.index("--http") + 1]
                shown = f"http://{address}/" if not address.endswith(":0") else f"the URL in {out / 'http.json'}"
                console.print(f"dashboard: {shown}")
        common = ["--config", str(config_path), "--federation", federation, *verbosity, *access]
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
                *(coordinator_flags or []),
                "--log-file",
                str(logs / "coordinator.log"),
            ],
            logs / "coordinator.out",
        )
        if cfg.hierarchy.sites:
            await _start_sites(children, cfg, broker, out, config_path, processes, [*verbosity, *threads])
        else:
            await _start_node_hosts(children, broker, cfg.node_ids(), processes, [*common, *threads], logs, "nodes")
        monitor = asyncio.create_task(_monitor(cfg, broker, federation, console, quiet, monitor_access))
        try:
            await asyncio.wait_for(coordinator.wait(), timeout_s)
        except TimeoutError:
            console.print(f"[red]stopping: --timeout of {timeout_s:g} s reached[/]")
            await children.stop(["coordinator"], grace_s=15)
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError, BusError):
                await monitor
        node_names = [n for n in children.procs if n.startswith(("nodes-", "aggregator-"))]
        try:
            await asyncio.wait_for(asyncio.gather(*(children.procs[n].wait() for n in node_names)), 15)
        except TimeoutError:
            await children.stop(node_names)
    except asyncio.CancelledError:
        return EXIT_INTERRUPTED
    finally:
        await asyncio.shield(children.stop())
    return _report(out, console, coordinator.returncode, time.monotonic() - started, quiet)


async def _start_node_hosts(
    children: Children, broker: str, node_ids: list[str], processes: int, args: list[str], logs: Path, name: str
) -> None:
    """`node_ids` split among `processes` node-host processes named NAME-0, NAME-1, ..."""
    for i, group in enumerate(split_evenly(node_ids, processes)):
        ids = [arg for node in group for arg in ("--node-id", node)]
        log = logs / f"{name}-{i}.log"
        command = ["node", "--broker", broker, *ids, *args, "--exit-when-done", "--log-file", str(log)]
        await children.start(f"{name}-{i}", command, logs / f"{name}-{i}.out")


async def _start_sites(
    children: Children,
    cfg: ExperimentConfig,
    central: str,
    out: Path,
    config_path: Path,
    processes: int,
    args: list[str],
) -> None:
    """Each site of a hierarchical run: its broker bridged to `central` (or `central` itself without
    hierarchy.bridge), its aggregator workers, and node hosts for its nodes (at least one a site)."""
    federation = str(cfg.federation)
    logs = out / "logs"
    per_site = max(1, processes // cfg.hierarchy.sites)
    for site, node_ids in cfg.site_nodes().items():
        url = central
        if cfg.hierarchy.bridge:
            port = free_port()
            url = f"mqtt://127.0.0.1:{port}"
            command = ["broker", "--port", str(port), "--bridge", central, "--site", site, "--federation",
                       federation, "--state-dir", str(out / "brokers" / site),
                       "--log-file", str(logs / f"broker-{site}.log")]  # fmt: skip
            proc = await children.start(f"broker-{site}", command, logs / f"broker-{site}.out")
            await asyncio.to_thread(wait_for_port, "127.0.0.1", port, 20.0)
            if proc.returncode is not None:
                raise BusError(f"the broker of {site} exited at start; see {logs / f'broker-{site}.out'}")
        common = ["--config", str(config_path), *args]
        for worker in range(cfg.hierarchy.workers):
            name = site if cfg.hierarchy.workers == 1 else f"{site}-w{worker}"
            command = ["aggregator", "--broker", url, "--site", site, "--worker", str(worker),
                       "--federation", federation, "--out", str(out / "sites" / name), "--exit-when-done",
                       *common, "--log-file", str(logs / f"aggregator-{name}.log")]  # fmt: skip
            await children.start(f"aggregator-{name}", command, logs / f"aggregator-{name}.out")
        site_args = [*common, "--federation", site_federation(federation, site)]
        await _start_node_hosts(children, url, node_ids, per_site, site_args, logs, f"nodes-{site}")


def _provision_run(directory: Path, cfg: ExperimentConfig, federation: str) -> Provisioned:
    """A fresh CA, broker certificate and credentials for this run alone (a rerun replaces them), for a
    broker that runs as the user who started the run."""
    if directory.exists():
        shutil.rmtree(directory)
    import pwd

    user = pwd.getpwuid(os.geteuid()).pw_name
    return provision(directory, federation=federation, nodes=cfg.node_ids(), port=free_port(), broker_user=user)


async def _monitor(
    cfg: ExperimentConfig, url: str, federation: str, console: Console, quiet: bool, access: Access
) -> None:
    """Follow the coordinator's status topic: a progress bar on a terminal, a line per round otherwise."""
    topics = Topics(federation)
    # with a folder of credentials the monitor has its own identity (only the coordinator's status to read)
    identity = MONITOR if access.source is not None and access.source.is_dir() else COORDINATOR
    overrides = access.bus_overrides(identity)
    bus_config = BusConfig.from_url(url, protocol=cfg.bus.protocol, persistent_session=False, **overrides)
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
            task = progress.add_task(f"{cfg.step_name}s", total=cfg.steps, status="waiting for nodes")
            first: tuple[float, int] | None = None  # (when, rounds done) at the first round's end
            async for envelope in bus.messages():
                if envelope.message.kind != Kind.COORDINATOR_STATUS:
                    continue
                meta: dict[str, Any] = dict(envelope.message.meta)
                done = int(meta.get("round_done", -1)) + 1
                accuracy = meta.get("accuracy")
                status = f"live {meta.get('live_nodes', 0)}" + (f"  acc {accuracy:.4f}" if accuracy is not None else "")
                progress.update(task, completed=done, status=status)
                if not quiet and not console.is_terminal and "round_done" in meta:
                    now = time.monotonic()
                    first = first or (now, done)
                    eta = ""
                    if done > first[1]:
                        eta = f"  {(now - first[0]) / (done - first[1]) * (cfg.steps - done):.0f} s left"
                    console.print(f"{cfg.step_name} {done}/{cfg.steps} {status}{eta}")


def _pace(cfg: ExperimentConfig) -> str:
    """How the run proceeds, in a few words for its first line."""
    if cfg.engine.kind == "async":
        e = cfg.engine
        rule = "FedAsync" if e.buffer == 1 else f"FedBuff K={e.buffer}"
        return f"async {rule}, {e.concurrency} training at once, {e.aggregations} versions"
    return f"C={cfg.fraction}, {cfg.rounds} rounds"


def _report(out: Path, console: Console, returncode: int | None, wall: float, quiet: bool) -> int:
    summary_path = out / "summary.json"
    if not summary_path.exists():
        console.print(f"[red]the coordinator wrote no summary (exit code {returncode}); see {out / 'logs'}[/]")
        # its configuration or its broker (exit 2 or 3) is what went wrong, not the federation
        return returncode if returncode in (EXIT_CONFIG, EXIT_BUS) else EXIT_FAILED
    summary = json.loads(summary_path.read_text())
    final, best = summary.get("final_accuracy"), summary.get("best_accuracy")
    if summary.get("state") != "finished" or returncode != 0:
        console.print(
            f"[red]run {summary.get('state')} after {summary.get('rounds_completed')} {_steps(summary)};"
            f" see {out / 'logs'}[/]"
        )
        return EXIT_FAILED
    totals = summary.get("participation_totals", {})
    rejected = summary.get("bus", {}).get("rejected", {})
    console.print(
        f"[bold green]final accuracy {final:.4f}[/] (best {best:.4f}) after {summary['rounds_completed']}"
        f" {_steps(summary)},"
        f" {wall:.1f} s wall; updates accepted {totals.get('accepted')}, late {totals.get('late')},"
        f" lost {totals.get('lost')}" + (f"; rejected messages {rejected}" if rejected else "")
    )
    console.print(f"results: {out}/summary.json, metrics.jsonl, participation.json")
    return EXIT_OK


def _steps(summary: dict[str, Any]) -> str:
    return "model versions" if summary.get("engine") == "async" else "rounds"
