"""One node process: its start-up time and resident memory, on the experiment's partition and on its
own data (`fedmq node --data`).

For each experiment, one `fedmq node` process for node-000 (one torch thread, the CPU) is started
against a broker, once the way an experiment's node hosts run (the whole dataset loaded from the
data root, partitioned, the node's shard kept) and once the way a deployed node runs (``--data``:
node-000's shard saved as an .npz, an empty data root, nothing else read). Measured per process:
the time from starting it to its retained "online" status reaching a subscriber on the broker, its
peak resident memory (the kernel's VmHWM) and its resident memory a moment after that (VmRSS,
steady: connected and idle, waiting for a task). The two ways alternate, run after run, and each
figure is the median. Beside them, the floor that every node pays: an interpreter that only imports
torch and fedmq's node modules.

The decoded-array cache is warm for the partition path (this suite saves the shard first, which
loads the dataset once); one more run with an empty cache shows a node's first start, which decodes
the dataset's files first (not in --quick mode, and not for the datasets made in memory).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedmq.broker import BusClient, BusConfig, Kind, Topics
from fedmq.experiments.bench.brokers import broker_kind, running_broker
from fedmq.experiments.bench.common import MIB, BenchOptions, Report
from fedmq.experiments.build import load_split, save_shard
from fedmq.experiments.config import ExperimentConfig, load_config
from fedmq.experiments.grid import load_experiment
from fedmq.fedcore.data import DATASETS
from fedmq.fedcore.errors import ConfigError, DataError

TITLE = "one node process: start-up time and memory, on the partition and on its own data (--data)"

ROOT = Path(__file__).resolve().parents[2]
NODE = "node-000"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    file: str
    """An experiment file under the repository; a grid's first cell."""
    about: str


CASES = {
    "quickstart": Case("quickstart", "experiments/quickstart.yaml", "digits, CNN, 20 nodes (Dirichlet 0.3)"),
    "mnist": Case(
        "mnist", "experiments/papers/fedvls-reduced.yaml", "FedVLS's MNIST setting: 784-200-200-10 DNN, 10 nodes"
    ),
    "cifar10": Case(
        "cifar10", "experiments/papers/kdia-reduced.yaml", "KDIA's CIFAR-10 setting: MOON's CNN, 100 nodes"
    ),
}


@dataclass(frozen=True, slots=True)
class Sample:
    startup_s: float
    peak_bytes: int
    steady_bytes: int


def _status_bytes(pid: int, key: str) -> int:
    """A memory field of /proc/PID/status (VmRSS, VmHWM) in bytes; 0 once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _config(case: Case) -> ExperimentConfig:
    path = ROOT / case.file
    grid = load_experiment(path)
    return grid.cells[0].config if grid.is_grid else load_config(path)


async def _online(bus: BusClient) -> None:
    async for envelope in bus.messages():
        message = envelope.message
        if message.kind == Kind.NODE_STATUS and message.meta.get("state") == "online":
            return


async def _start_node(url: str, protocol: str, config: Path, extra: list[str], env: dict[str, str], log: Path,
                      settle_s: float) -> Sample:  # fmt: skip
    """Start `fedmq node` for node-000; time it to its online status; its memory then, and `settle_s` later."""
    federation = f"bench-node-{os.urandom(4).hex()}"
    topics = Topics(federation)
    bus_config = BusConfig.from_url(url, protocol=protocol)  # type: ignore[arg-type]
    async with BusClient(bus_config, client_id=f"{federation}-watch", federation=federation) as bus:
        await bus.subscribe(topics.node_status(NODE))
        args = ["-m", "fedmq", "node", "--broker", url, "--config", str(config), "--node-id", NODE,
                "--federation", federation, "--threads", "1", "--device", "cpu", *extra]  # fmt: skip
        with log.open("ab") as out:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(sys.executable, *args, stdout=out, stderr=out, env=env)
        online, exited = asyncio.create_task(_online(bus)), asyncio.create_task(proc.wait())
        try:
            await asyncio.wait({online, exited}, timeout=300, return_when=asyncio.FIRST_COMPLETED)
            startup = time.monotonic() - started
            if not online.done():
                raise RuntimeError(f"fedmq node did not come online (exit code {proc.returncode}); see {log}")
            await asyncio.sleep(settle_s)  # connected and idle: what it holds while it waits for a task
            steady, peak = _status_bytes(proc.pid, "VmRSS"), _status_bytes(proc.pid, "VmHWM")
        finally:
            online.cancel()
            if proc.returncode is None:
                proc.terminate()
            try:
                await asyncio.wait_for(exited, 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    return Sample(startup, peak, steady)


def _floor() -> Sample:
    """An interpreter that imports what a node imports, and nothing more: the part every node pays
    (timed from starting it to the end of its imports, by the wall clock both processes share)."""
    code = (
        "import torch, experiments.cli, experiments.build, fednode.daemon, time; "
        "from pathlib import Path; s = Path('/proc/self/status').read_text().split(chr(10)); "
        "kb = lambda k: int(next(x for x in s if x.startswith(k + ':')).split()[1]) * 1024; "
        "print(time.time(), kb('VmHWM'), kb('VmRSS'))"
    )
    started = time.time()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    ended, peak, rss = done.stdout.split()
    return Sample(float(ended) - started, int(peak), int(rss))


def _median(samples: list[Sample]) -> Sample:
    return Sample(
        statistics.median(s.startup_s for s in samples),
        int(statistics.median(s.peak_bytes for s in samples)),
        int(statistics.median(s.steady_bytes for s in samples)),
    )


def run(options: BenchOptions) -> Report:
    names = ["quickstart"] if options.quick else str(options.extra.get("node_configs", ",".join(CASES))).split(",")
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise ConfigError(f"--opt node_configs: unknown {unknown}; choose from {', '.join(CASES)}")
    repeats = options.reps(3, quick=1)
    settle_s = float(options.extra.get("node_settle_s", 0.3 if options.quick else 2.0))
    kind = broker_kind(options)
    protocol = "3.1.1" if kind == "embedded" else "5"
    report = Report(
        "node",
        TITLE,
        context={
            "node": f"{NODE}, 1 torch thread, cpu",
            "broker": kind,
            "repeats": repeats,
            "settled": f"{settle_s:g} s",
        },
    )
    work = options.work_dir / "node"
    work.mkdir(parents=True, exist_ok=True)
    floor = _median([_floor() for _ in range(repeats)])
    report.add("start-up (interpreter and imports)", floor.startup_s, "s", section="floor: torch and fedmq imported")
    report.add("peak memory (VmHWM)", floor.peak_bytes / MIB, "MiB", section="floor: torch and fedmq imported")
    empty = Path(tempfile.mkdtemp(prefix="empty-root-", dir=work))
    with running_broker(options) as url:
        for name in names:
            case = CASES[name]
            cfg = _config(case)
            section = f"{name}: {case.about}"
            try:
                shard = work / f"{name}-{NODE}.npz"
                examples = save_shard(cfg, NODE, shard)  # loads the dataset here once: the cache is warm
                train = len(load_split(cfg).train)
            except DataError as exc:
                report.notes.append(f"{name}: skipped, its dataset is not here ({str(exc).splitlines()[0]})")
                continue
            config = work / f"{name}.yaml"
            config.write_text(cfg.to_yaml())
            env = dict(os.environ)
            own_env = env | {"FEDMQ_DATA_ROOT": str(empty), "FEDMQ_CACHE_DIR": str(empty / "cache")}
            modes = {"partition": ([], env), "--data": (["--data", str(shard)], own_env)}
            samples: dict[str, list[Sample]] = {mode: [] for mode in modes}
            for _ in range(repeats):  # alternated, so that a machine's drift moves both alike
                for mode, (extra, mode_env) in modes.items():
                    log = work / f"{name}-{'data' if extra else 'partition'}.log"
                    samples[mode].append(
                        asyncio.run(_start_node(url, protocol, config, extra, mode_env, log, settle_s))
                    )
            part, own = _median(samples["partition"]), _median(samples["--data"])
            note = f"{examples:,} of {train:,} training examples, shard file {shard.stat().st_size / MIB:.1f} MiB"
            report.add("partition: start-up to online", part.startup_s, "s", section=section, note=note)
            report.add("--data: start-up to online", own.startup_s, "s", section=section,
                       ratio=own.startup_s / part.startup_s, ratio_means="the partition path's")  # fmt: skip
            report.add("partition: peak memory (VmHWM)", part.peak_bytes / MIB, "MiB", section=section)
            report.add("--data: peak memory (VmHWM)", own.peak_bytes / MIB, "MiB", section=section,
                       ratio=own.peak_bytes / part.peak_bytes, ratio_means="the partition path's")  # fmt: skip
            report.add("partition: steady memory (VmRSS, idle)", part.steady_bytes / MIB, "MiB", section=section)
            report.add("--data: steady memory (VmRSS, idle)", own.steady_bytes / MIB, "MiB", section=section,
                       ratio=own.steady_bytes / part.steady_bytes, ratio_means="the partition path's")  # fmt: skip
            report.add("--data: peak above the floor", (own.peak_bytes - floor.peak_bytes) / MIB, "MiB",
                       section=section, note="what the node's data, model and connection add")  # fmt: skip
            if DATASETS[cfg.data.dataset].files and not options.quick:  # a first start: the files decoded
                cold = env | {"FEDMQ_CACHE_DIR": tempfile.mkdtemp(prefix="cold-cache-", dir=work)}
                log = work / f"{name}-cold.log"
                first = asyncio.run(_start_node(url, protocol, config, [], cold, log, settle_s))
                label = "partition, cold cache"
                vs = {"section": section, "ratio_means": "--data's"}
                report.add(f"{label}: start-up to online", first.startup_s, "s", note="one run",
                           ratio=first.startup_s / own.startup_s, **vs)  # fmt: skip
                report.add(f"{label}: peak memory (VmHWM)", first.peak_bytes / MIB, "MiB",
                           ratio=first.peak_bytes / own.peak_bytes, **vs)  # fmt: skip
    report.notes.append(
        "partition: the node loads the whole training set (from the warm decoded-array cache) and partitions it;"
        " --data: it reads only its .npz, with an empty data root"
    )
    return report
