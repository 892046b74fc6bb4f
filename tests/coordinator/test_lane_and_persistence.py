"""The coordinator's worker lane (order, errors, drain) and checkpoint persistence across engines."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.lane import Lane
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.fedcore.algorithms.fedavg import CoordinatorHalf, Hyperparams

pytestmark = pytest.mark.timed  # threads, waited with timeouts: never in the compute lane (conftest)


async def test_lane_runs_calls_one_at_a_time_in_order_off_the_event_loop() -> None:
    """Calls run in submission order on one thread that is not the loop's; outcomes come back in order."""
    lane = Lane()
    seen: list[tuple[int, object]] = []
    threads: set[int] = set()

    def call(i: int) -> int:
        threads.add(threading.get_ident())
        time.sleep(0.01 if i == 0 else 0)  # the first is slowest: order must not depend on speed
        return i * 10

    for i in range(5):
        lane.submit(lambda i=i: call(i), lambda result, exc: seen.append((result, exc)))
    await lane.drain()
    lane.close()
    assert seen == [(0, None), (10, None), (20, None), (30, None), (40, None)]
    assert threads and threading.get_ident() not in threads and len(threads) == 1


async def test_lane_hands_an_exception_to_its_callback_and_goes_on() -> None:
    lane = Lane()
    seen: list[object] = []

    def boom() -> None:
        raise ValueError("the half failed")

    lane.submit(boom, lambda result, exc: seen.append(exc))
    lane.submit(lambda: "next", lambda result, exc: seen.append(result))
    await asyncio.wait_for(lane.drain(), 5)
    lane.close()
    assert isinstance(seen[0], ValueError) and seen[1] == "next"


def _half() -> CoordinatorHalf:
    return CoordinatorHalf(Hyperparams(), model=nn.Linear(2, 1))


def test_resume_restores_the_half_and_refuses_another_engines_checkpoint(tmp_path: Path) -> None:
    """A checkpoint comes back into a fresh half; one made by the async engine is refused by a sync
    run (and one of another federation or seed by any run), with what to do."""
    saved = Persistence(RunDir(tmp_path), _half())
    meta = {"engine": "async", "federation": "f", "seed": 0, "participation": {}, "round": 3}
    saved.run_dir.save_checkpoint(saved.snapshot(), meta)
    fresh = Persistence(RunDir(tmp_path), _half())
    assert fresh.resume(federation="f", seed=0, engine="async") == meta
    assert torch.equal(fresh.half.model.weight, saved.half.model.weight)
    with pytest.raises(CoordinatorError, match="made by the async engine, this run is sync"):
        fresh.resume(federation="f", seed=0, engine="sync")
    with pytest.raises(CoordinatorError, match="another federation or seed"):
        fresh.resume(federation="f", seed=1, engine="async")
