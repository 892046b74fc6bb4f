"""Flower as its users run it, driven from the flower suite: its environment, its daemons, `flwr run`.

Flower's pins (flwr 1.41: typer < 0.21, rich < 15, packaging < 26) conflict with what fedmq's own
environment holds (amqtt 0.12 needs typer >= 0.24), so Flower gets its own virtualenv (the ``bench``
extra installs it into fedmq's only where that downgrade is acceptable). The virtualenv is layered
on the running one (a ``.pth`` file adds its site-packages after Flower's own), so torch and fedmq
are the very same and only Flower and what it pins are installed: about 50 s and 400 MB, once.

Both of Flower's runtimes run the App in ``flower_app/`` with ``flwr run``: the simulation runtime
(``flower-superlink --simulation``: Ray actors, one client at a time by default on 2 cores), and the
deployment runtime (``flower-superlink`` and one ``flower-supernode`` per node on loopback, insecure,
default isolation: a ClientApp process per message). Every process started here is stopped with its
descendants (SuperExec, ServerApp, ClientApp, Ray) whatever happens, and Flower's state, logs and
Ray's files stay under the suite's work directory.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedmq.broker.errors import BusError
from fedmq.broker.servers.mosquitto import free_port, wait_for_port
from fedmq.experiments.bench.procs import descendants, proc_stat

FLWR_REQUIREMENT = "flwr[simulation]>=1.20,<2"
"""Kept equal to the ``bench`` extra in pyproject.toml (a test checks)."""

APP_DIR = Path(__file__).resolve().parent / "flower_app"
REPO_ROOT = Path(__file__).resolve().parents[2]
Log = Callable[[str], None]


class FlowerError(RuntimeError):
    """Flower could not be installed, started or run; the message says where its logs are."""


@dataclass(frozen=True, slots=True)
class FlowerEnv:
    python: Path
    version: str

    @property
    def bin_dir(self) -> Path:
        return self.python.parent


def _probe(python: Path) -> str | None:
    """flwr's version in the environment of `python`, or None when it (or its simulation extra) is missing."""
    if not python.exists():
        return None
    code = "import flwr, flwr.simulation, ray; print(flwr.__version__)"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False)
    return done.stdout.strip() if done.returncode == 0 else None


def flower_env(venv: Path, log: Log) -> FlowerEnv:
    """This interpreter when flwr is installed here (the ``bench`` extra), else the virtualenv `venv`,
    made on first use."""
    here = Path(sys.executable)
    version = _probe(here)
    if version is None:
        python = venv / "bin" / "python"
        version = _probe(python)
        if version is None:
            _make_venv(venv, log)
            version = _probe(python)
            if version is None:
                raise FlowerError(f"flwr does not import in {venv} after installing {FLWR_REQUIREMENT}")
        here = python
    return FlowerEnv(here, version)


def _make_venv(venv: Path, log: Log) -> None:
    log(f"installing {FLWR_REQUIREMENT} into {venv} (once; about a minute) ...")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    # After Flower's own packages: torch, numpy and fedmq (its editable install) come from ours.
    layer = f"import site; site.addsitedir({ours!r})\n{REPO_ROOT}\n"
    (Path(purelib) / "_fedmq_base.pth").write_text(layer)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", FLWR_REQUIREMENT],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise FlowerError(
            f"pip install {FLWR_REQUIREMENT} failed in {venv}:\n{done.stderr[-2000:]}\n"
            f"install it yourself (pip install -e '.[bench]') or pass --opt flower_venv=PATH"
        )


def _alive(pid: int, started: int) -> bool:
    """Still that process, and not a zombie (whose parent has not collected it yet)."""
    stat = proc_stat(pid)
    return stat is not None and stat.started == started and stat.state != "Z"


def _signal(pid: int, started: int, sig: signal.Signals) -> None:
    """Signal `pid` only if it is still the process that started at `started` (never a reused pid)."""
    stat = proc_stat(pid)
    if stat is not None and stat.started == started:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class Processes:
    """The Flower processes the suite started; `stop` ends each with all its descendants, by pid."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.logs.mkdir(parents=True, exist_ok=True)
        out = (self.logs / f"{name}.log").open("wb")
        self._files.append(out)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def stop(self, grace_s: float = 10.0) -> None:
        pids = [p for proc in self.procs.values() for p in (proc.pid, *descendants(proc.pid))]
        started = {pid: stat.started for pid in pids if (stat := proc_stat(pid)) is not None}
        for pid, start in started.items():
            _signal(pid, start, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for pid, start in started.items():  # whatever ignored SIGTERM (Ray's workers may)
            _signal(pid, start, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        deadline = time.monotonic() + 5
        while any(_alive(pid, start) for pid, start in started.items()) and time.monotonic() < deadline:
            time.sleep(0.05)  # killed processes take a moment to exit on a busy machine
        for file in self._files:
            file.close()
        self.procs.clear()
        self._files.clear()


@dataclass(frozen=True, slots=True)
class FlowerRun:
    """What a `flwr run` of the App measured: wall-clock times of its records, from its launch."""

    launched: float
    started: float
    """When the ServerApp began its first round (after loading the workload)."""
    rounds: list[dict[str, Any]]
    """Per round: round (0-based), accuracy, loss, time (wall clock)."""
    finished: float

    @property
    def wall_s(self) -> float:
        return self.finished - self.launched

    def round_seconds(self) -> list[float]:
        times = [self.started] + [r["time"] for r in self.rounds]
        return [b - a for a, b in itertools.pairwise(times)]


class Runtime:
    """A SuperLink (simulation or deployment runtime) and, for deployment, its SuperNodes, on loopback."""

    def __init__(self, env: FlowerEnv, work: Path, *, simulation: bool, nodes: int, log: Log) -> None:
        self.env = env
        self.work = work
        self.simulation = simulation
        self.nodes = nodes
        self.log = log
        self.home = work / "flwr-home"
        self.port = free_port()
        self._ray_tmp: Path | None = None
        self.processes = Processes(self._environ(), work / "logs")
        self.startup_s = 0.0

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PATH=f"{self.env.bin_dir}{os.pathsep}{env.get('PATH', '')}",  # SuperExec is found on PATH
            FLWR_HOME=str(self.home),
            FLWR_TELEMETRY_ENABLED="0",
            FLWR_DISABLE_UPDATE_CHECK="1",
            PYTHONUNBUFFERED="1",
            NO_COLOR="1",
            COLUMNS="200",
        )
        if self.simulation:
            self._ray_tmp = self._ray_dir()
            env["RAY_TMPDIR"] = str(self._ray_tmp)
        return env

    def _ray_dir(self) -> Path:
        """Ray's files under the work directory, unless that path is too long for its sockets: Ray adds
        ``/ray/session_<date>_<time>_<us>_<pid>/sockets/plasma_store`` (up to 68 bytes) and a socket's
        path must fit in 107; a short folder in /tmp then, removed at the end."""
        wanted = (self.work / "ray").resolve()
        if len(str(wanted)) <= 38:
            wanted.mkdir(parents=True, exist_ok=True)
            return wanted
        return Path(tempfile.mkdtemp(prefix="fedmq-ray-"))

    def __enter__(self) -> Runtime:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.processes.stop()
        if self._ray_tmp is not None and not self._ray_tmp.is_relative_to(self.work.resolve()):
            subprocess.run(["rm", "-rf", str(self._ray_tmp)], check=False, timeout=60)

    def _start(self) -> None:
        started = time.monotonic()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n'
        )
        bin_dir = self.env.bin_dir
        link = [str(bin_dir / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(self.port)]
        link.append("--disable-runtime-dependency-installation")  # never `uv sync` the App's dependencies
        if self.simulation:
            link.append("--simulation")
        proc = self.processes.start("superlink", link)
        self._wait_port(self.port, proc, "superlink")
        for i in range(0 if self.simulation else self.nodes):
            self.processes.start(
                f"supernode-{i}",
                [
                    str(bin_dir / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                    "--node-config", f"partition-id={i} num-partitions={self.nodes}", "--port", str(free_port()),
                ],
            )  # fmt: skip
        self._wait_registered(timeout_s=120)
        self.startup_s = time.monotonic() - started

    def _wait_port(self, port: int, proc: subprocess.Popen[bytes], name: str) -> None:
        try:
            wait_for_port("127.0.0.1", port, 60.0, proc)
        except BusError as exc:  # wait_for_port speaks of a broker
            raise FlowerError(f"{name} did not start: see {self.processes.logs / name}.log ({exc})") from exc

    def _wait_registered(self, timeout_s: float) -> None:
        """Until every SuperNode has its node id (its log says so): the runs are timed from a ready federation."""
        deadline = time.monotonic() + timeout_s
        waiting = [n for n in self.processes.procs if n.startswith("supernode-")]
        while waiting:
            for name in list(waiting):
                proc = self.processes.procs[name]
                if proc.poll() is not None:
                    raise FlowerError(f"{name} exited with {proc.returncode}: see {self.processes.logs / name}.log")
                if "SuperNode ID" in (self.processes.logs / f"{name}.log").read_text(errors="replace"):
                    waiting.remove(name)
            if time.monotonic() > deadline:
                raise FlowerError(f"{', '.join(waiting)} not registered after {timeout_s:g} s: see their logs")
            time.sleep(0.2)

    def run(self, workload: Path, method: str, name: str, *, timeout_s: float, torch_threads: int = 0) -> FlowerRun:
        """`flwr run` the App on `workload` and wait for it; the ServerApp's records give the times."""
        results = self.work / f"{name}.jsonl"
        results.unlink(missing_ok=True)
        overrides = f'workload="{workload.resolve()}" results="{results.resolve()}" method="{method}"'
        argv = [str(self.env.bin_dir / "flwr"), "run", str(APP_DIR), "bench", "--run-config", overrides]
        argv += ["--run-config", f"torch-threads={torch_threads}", "--stream"]
        if self.simulation:
            argv += ["--federation-config", f"num-supernodes={self.nodes}"]
        log_path = self.processes.logs / f"{name}.log"
        launched = time.time()
        with log_path.open("wb") as out:
            try:
                subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=self.processes.env, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise FlowerError(f"flwr run {name} took over {timeout_s:g} s: see {log_path}") from None
        return _read_run(results, launched, log_path)


def _read_run(results: Path, launched: float, log_path: Path) -> FlowerRun:
    try:
        records = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    except OSError:
        records = []
    start = next((r for r in records if r["event"] == "start"), None)
    done = next((r for r in records if r["event"] == "done"), None)
    if start is None or done is None:
        raise FlowerError(f"the Flower run did not finish: see {log_path} and the logs beside it")
    rounds = [r for r in records if r["event"] == "round"]
    return FlowerRun(launched, start["time"], rounds, done["time"])
