"""Shared fixtures: real brokers on free loopback ports, started once per session, and unique
federation ids so that tests never see each other's retained messages."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedmq.broker import BusConfig
from fedmq.broker.servers.mosquitto import find_mosquitto, free_port, start_mosquitto, wait_for_port
from fedmq.broker.tuning import tune_process
from fedmq.fedcore.seeding import deterministic_kernels

BROKERS = ["embedded", "mosquitto"]


ROOT = Path(__file__).resolve().parents[1]
COMPUTE_PATHS = (
    "tests/fedcore/", "tests/algorithms/", "tests/coordinator/", "tests/protocol/", "tests/experiments/",
    "tests/test_api.py", "tests/test_boundaries.py", "tests/test_fields.py",
)  # fmt: skip
"""Where the tests that only compute live (no broker, no process of their own, no real-time wait),
unless marked ``slow`` or ``timed``: the compute lane of `scripts/test`."""
LANES = ("compute", "timed")


def pytest_configure(config: pytest.Config) -> None:
    """The test process is an entry point: its in-process clients take the daemons' fast paths, and on
    a GPU its training runs with the deterministic kernels that fedmq's processes choose (the GPU
    tests check bitwise repeats of functions they call directly, outside any workspace)."""
    tune_process(BusConfig())
    deterministic_kernels("cuda")
    lane = os.environ.get("FEDMQ_TEST_LANE", "")
    if lane and lane not in LANES:
        raise pytest.UsageError(f"FEDMQ_TEST_LANE={lane!r}: choose {' or '.join(LANES)}, or leave it unset")


def _computes_only(item: pytest.Item) -> bool:
    path = Path(str(item.fspath)).resolve().relative_to(ROOT).as_posix()
    marked = item.get_closest_marker("slow") or item.get_closest_marker("timed")
    return marked is None and path.startswith(COMPUTE_PATHS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`scripts/test` runs two lanes at once: ``compute`` (tests that only compute, at a low CPU
    priority) and ``timed`` (everything else: brokers, processes, deadlines), so that the first use
    the CPU the second leaves idle without slowing what the second times. Together they are every test;
    with FEDMQ_TEST_LANE unset, one run holds them all."""
    lane = os.environ.get("FEDMQ_TEST_LANE", "")
    if not lane:
        return
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (keep if _computes_only(item) == (lane == "compute") else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def _start_embedded(log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedmq",
                "broker",
                "--embedded",
                "--port",
                str(port),
                "-v",
                "--log-file",
                str(log),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    wait_for_port("127.0.0.1", port, 30.0, proc)
    return proc, port


@pytest.fixture(scope="session")
def embedded_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, port = _start_embedded(tmp_path_factory.mktemp("embedded-broker") / "broker.log")
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def mosquitto_broker() -> Iterator[str]:
    if find_mosquitto() is None:
        if os.environ.get("FEDMQ_REQUIRE_MOSQUITTO"):
            pytest.fail("mosquitto is required (FEDMQ_REQUIRE_MOSQUITTO is set) but not installed")
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    port = free_port()
    proc = start_mosquitto(port)
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(params=BROKERS)
def broker_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs once against the embedded broker and once against mosquitto."""
    return str(request.getfixturevalue(f"{request.param}_broker"))


@pytest.fixture
def federation(request: pytest.FixtureRequest) -> str:
    return f"t{os.urandom(4).hex()}"


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The shared real datasets: FEDMQ_DATA_ROOT, else ../shared/data next to the checkout.

    Skips when absent, unless FEDMQ_REQUIRE_DATA is set (CI sets it where the data exists).
    """
    root = Path(os.environ.get("FEDMQ_DATA_ROOT") or Path(__file__).resolve().parents[2] / "shared" / "data")
    if not root.is_dir():
        if os.environ.get("FEDMQ_REQUIRE_DATA"):
            pytest.fail(f"FEDMQ_REQUIRE_DATA is set but the data root {root} does not exist")
        pytest.skip(f"no dataset root at {root}; set FEDMQ_DATA_ROOT")
    return root


@pytest.fixture
def one_thread() -> Iterator[None]:
    """`tests.helpers.one_torch_thread` around a test (a module-scoped run is made before it: wrap it)."""
    from tests.helpers import one_torch_thread

    with one_torch_thread():
        yield
