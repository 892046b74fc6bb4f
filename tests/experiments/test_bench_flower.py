"""`fedmq bench flower`: the workload both frameworks run is fedmq's own FedAvg, step for step.

The Flower pieces run in Flower's environment: this interpreter when flwr is installed here (the
``bench`` extra), else the virtualenv named by FEDMQ_FLOWER_VENV (the suite makes one under its work
directory: ``runs/bench/flower-venv``). Without either, the tests that need Flower are skipped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedmq.experiments.bench import flower
from fedmq.experiments.bench.common import BenchOptions
from fedmq.experiments.bench.flower_runtime import APP_DIR, FLWR_REQUIREMENT, FlowerEnv, Processes
from fedmq.experiments.bench.flower_workload import Workload, WorkloadSpec, experiment
from fedmq.experiments.bench.procs import descendants
from fedmq.experiments.build import load_split, make_model, shards
from fedmq.experiments.config import load_config
from fedmq.experiments.local import build_local
from fedmq.fedcore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = WorkloadSpec(dataset="digits", nodes=3, rounds=2, hidden=(16,))


def flower_python() -> Path | None:
    if importlib.util.find_spec("flwr") is not None:
        return Path(sys.executable)
    venv = os.environ.get("FEDMQ_FLOWER_VENV")
    python = Path(venv) / "bin" / "python" if venv else None
    return python if python is not None and python.exists() else None


needs_flower = pytest.mark.skipif(
    flower_python() is None,
    reason="flwr is not installed: pip install -e '.[bench]', or set FEDMQ_FLOWER_VENV to the suite's flower-venv",
)
pytestmark = pytest.mark.timed  # Flower's processes, with timeouts: never in the compute lane (conftest)


def fedmq_models(yaml_path: Path, rounds: int) -> list[dict[str, torch.Tensor]]:
    """The global model after each of the first `rounds` rounds of the workload's experiment run by
    fedmq's coordinator engine in process (`experiments.local.build_local`: the data, shards, model,
    halves, settings and seeds `fedmq run` gives the daemons), on the CPU as the Workload trains."""
    fed = build_local(load_config(yaml_path), device=torch.device("cpu"))
    models = []
    for done in range(1, rounds + 1):
        fed.run(until=lambda done=done: fed.engine.version >= done)  # after the aggregation, before the next round
        models.append(fed.model())
    return models


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "workload.yaml"
    path.write_text(experiment(TINY, "tiny").to_yaml())
    return path


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_workload_two_rounds_equal_fedmq_fedavg_halves(tiny_yaml: Path) -> None:
    """Workload's train/aggregate (what the Flower apps call) equals fedmq's FedAvg halves, bit for bit."""
    work = Workload.from_file(tiny_yaml)
    state = work.initial_state()
    expected = fedmq_models(tiny_yaml, 2)
    for rnd in range(2):
        state = work.aggregate([work.train(n, state, rnd) for n in reversed(work.node_ids)], rnd)  # any reply order
        assert_same_state(state, expected[rnd])
    assert work.evaluate(state)[0] > 0.2  # it learned something (10 classes: chance is 0.1)


def test_workload_server_and_client_views_build_the_same_shards_and_model(tiny_yaml: Path) -> None:
    """The ServerApp's and each ClientApp's Workload, loaded from the YAML, agree with each other and fedmq."""
    server, client = Workload.from_file(tiny_yaml), Workload.from_file(tiny_yaml)
    cfg = load_config(tiny_yaml)
    split = load_split(cfg)
    assert_same_state(server.initial_state(), client.initial_state())
    assert_same_state(server.initial_state(), make_model(cfg, split.test).state_dict())
    for node_id, idx in shards(cfg, split).items():
        assert (client.parts[node_id] == idx).all()
    assert [client.node_id(p) for p in range(3)] == cfg.node_ids()
    with pytest.raises(ValueError, match="partition 3"):
        client.node_id(3)


def test_workload_noop_returns_the_model_it_received() -> None:
    """noop: the node's update is the global model, as fedmq's noop node half does."""
    work = Workload(experiment(WorkloadSpec(dataset="digits", nodes=2, rounds=1, hidden=(8,), method="noop"), "n"))
    state = work.initial_state()
    result = work.train(work.node_ids[0], state, 0)
    assert_same_state(result.state, state)


def test_workload_spec_rejects_a_method_it_does_not_compare() -> None:
    with pytest.raises(ValueError, match="fedavg, noop"):
        WorkloadSpec(method="fedprox")


def test_settings_quick_defaults_and_opts_override() -> None:
    """--quick is tiny; --opt values are parsed by type; an unknown key is a ConfigError naming the known ones."""
    quick = flower.Settings.from_options(BenchOptions(quick=True))
    assert (quick.dataset, quick.nodes, quick.rounds, quick.flower_threads) == ("digits", 2, 2, 1)
    opts = BenchOptions(quick=True, extra={"nodes": "4", "sim_overhead": "yes", "dataset": "digits"})
    changed = flower.Settings.from_options(opts)
    assert (changed.nodes, changed.sim_overhead) == (4, True)
    with pytest.raises(ConfigError, match="knows dataset, nodes"):
        flower.Settings.from_options(BenchOptions(extra={"node": "4"}))
    with pytest.raises(ConfigError, match="not a yes/no"):
        flower.Settings.from_options(BenchOptions(extra={"sim_overhead": "maybe"}))


def test_bench_extra_is_the_requirement_the_suite_installs() -> None:
    """pyproject's `bench` extra and the suite's own Flower environment ask for the same flwr."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["optional-dependencies"]["bench"] == [FLWR_REQUIREMENT]
    app = tomllib.loads((APP_DIR / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert set(app["config"]) == {"workload", "results", "method", "torch-threads"}


class FakeRuntime:
    """Stands in for Flower's runtimes: records what the suite asked it to run."""

    def __init__(self, env: FlowerEnv, work: Path, *, simulation: bool, nodes: int, log: object) -> None:
        self.simulation = simulation
        self.startup_s = 1.5

    def __enter__(self) -> FakeRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_run_reports_figures_ratios_and_both_targets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The suite's report from given measurements: every figure, the ratios to fedmq's, and the targets."""
    fedmq_train = flower.Measured("fedmq", 10.0, [2.0, 1.0, 1.0], [0.5, 0.8, 0.9], [6.0, 8.0, 10.0])
    fedmq_noop = flower.Measured("fedmq", 5.0, [0.05, 0.04, 0.04], [0.1, 0.1, 0.1], [4.9, 4.95, 5.0])
    flwr_runs = {
        ("sim-train", "fedavg"): flower.Measured("sim", 25.0, [9.0, 3.0, 3.0], [0.5, 0.8, 0.9], [19.0, 22.0, 25.0]),
        ("deploy-train", "fedavg"): flower.Measured("dep", 60.0, [20.0, 20.0, 20.0], [0.5, 0.8, 0.9], [20, 40, 60]),
        ("deploy-noop", "noop"): flower.Measured("dep", 30.0, [7.0, 6.0, 6.0], [0.1, 0.1, 0.1], [10, 20, 30]),
    }

    def fake_fedmq(cfg: object, out: Path, url: str, *, timeout_s: float) -> flower.Measured:
        return fedmq_noop if "noop" in out.name else fedmq_train

    def fake_flower(rt: object, workload: Path, method: str, name: str, **kwargs: object) -> flower.Measured:
        return flwr_runs[(name, method)]

    @contextlib.contextmanager
    def fake_broker(options: BenchOptions) -> Iterator[str]:
        yield "mqtt://127.0.0.1:1"

    monkeypatch.setattr(flower, "flower_env", lambda venv, log: FlowerEnv(Path(sys.executable), "9.9"))
    monkeypatch.setattr(flower, "Runtime", FakeRuntime)
    monkeypatch.setattr(flower, "measure_fedmq", fake_fedmq)
    monkeypatch.setattr(flower, "measure_flower", fake_flower)
    monkeypatch.setattr(flower, "running_broker", fake_broker)
    report = flower.run(BenchOptions(quick=True, broker="mosquitto", work_dir=tmp_path))

    values = {f.label: f for f in report.figures}
    assert values["Flower simulation: wall time"].ratio == pytest.approx(2.5)
    assert values["Flower deployment: seconds per round (median)"].ratio == pytest.approx(20.0)
    assert values["Flower deployment: final accuracy"].value == pytest.approx(0.9)
    assert values["Flower simulation: launch to first round"].value == pytest.approx(10.0)  # 19 - 9
    assert values["Flower simulation: launch to first round"].ratio == pytest.approx(2.5)  # vs fedmq's 6 - 2
    assert values["Flower deployment: seconds per round (median)"].section == "FedAvg workload"
    overhead = [f for f in report.figures if f.section.startswith("Round overhead")]
    assert [f.label for f in overhead] == [
        "fedmq over mosquitto: round overhead",
        "Flower deployment: round overhead",
    ]
    assert overhead[1].ratio == pytest.approx(150.0)
    overhead_target, accuracy_target = report.targets
    assert overhead_target.met and "150x" in overhead_target.measured
    assert accuracy_target.met and "2.50x to accuracy 0.9000" in accuracy_target.measured
    assert report.context["flwr"] == "9.9"
    assert (tmp_path / "flower" / "workload.yaml").exists()


def run_in_flower(script: str, *args: str) -> str:
    python = flower_python()
    assert python is not None
    env = dict(os.environ, PYTHONPATH=f"{APP_DIR}{os.pathsep}{ROOT}")
    done = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


FLOWER_ROUND = """
import sys
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from safetensors.torch import save_file
from fedmq.experiments.bench.flower_workload import Workload
from fedmq_flower_app.client_app import train
from fedmq_flower_app.server_app import FedmqFedAvg
from flwr.supercore.task_identity import TaskIdentity

path, out = sys.argv[1], sys.argv[2]
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1  # what Flower's runtime sets in an app process
work = Workload.from_file(path)
run_config = {"workload": path, "results": "", "method": "fedavg", "torch-threads": 0}
arrays = ArrayRecord(work.initial_state())
replies = []
for partition in range(len(work.node_ids)):
    content = RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": 1})})
    msg = Message(content=content, dst_node_id=partition + 1, message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = msg.object_id  # what the SuperLink sets when it stores a message
    context = Context(run_id=1, node_id=partition + 1, node_config={"partition-id": partition},
                      state=RecordDict(), run_config=run_config)
    replies.append(train(msg, context))
aggregated, metrics = FedmqFedAvg(work).aggregate_train(1, replies[::-1])
save_file(dict(aggregated.to_torch_state_dict()), out)
"""


@needs_flower
def test_flower_apps_compute_fedmqs_fedavg_round(tiny_yaml: Path, tmp_path: Path) -> None:
    """The ClientApp's train and the ServerApp's aggregation, called as Flower calls them, give fedmq's round."""
    out = tmp_path / "flower-round.safetensors"
    run_in_flower(FLOWER_ROUND, str(tiny_yaml), str(out))
    assert_same_state(load_file(str(out)), fedmq_models(tiny_yaml, 1)[0])


@needs_flower
@pytest.mark.slow
def test_run_quick_against_flower_reports_every_figure(tmp_path: Path) -> None:
    """`fedmq bench flower --quick` on the smallest federation: every figure measured, both targets
    judged, and Flower's accuracy after each round is fedmq's (the same computation)."""
    python = flower_python()
    assert python is not None
    extra = {"nodes": "2", "rounds": "1", "overhead_rounds": "1", "flower_venv": str(python.parent.parent)}
    report = flower.run(BenchOptions(quick=True, work_dir=tmp_path, extra=extra))
    labels = [f.label for f in report.figures]
    assert len(labels) == len(set(labels)) == 14 and all(f.value > 0 for f in report.figures), labels
    accuracy = {f.label: f.value for f in report.figures if f.label.endswith("final accuracy")}
    assert len(accuracy) == 3 and max(accuracy.values()) - min(accuracy.values()) < 0.02, accuracy
    assert len(report.targets) == 2


def test_processes_stop_ends_every_descendant(tmp_path: Path) -> None:
    """Processes.stop ends what it started and their children (SuperExec, ClientApps, Ray), by pid."""
    procs = Processes(dict(os.environ), tmp_path)
    proc = procs.start("tree", ["sh", "-c", "sleep 60 & sleep 60 & wait"])
    deadline = time.monotonic() + 10
    while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = descendants(proc.pid)
    assert len(children) == 2
    procs.stop(grace_s=5)
    assert proc.returncode is not None
    for pid in children:  # gone, or a zombie left to init
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        )
