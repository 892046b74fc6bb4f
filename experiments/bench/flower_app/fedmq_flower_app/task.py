"""The workload as an app process holds it (torch and fedmq are imported here, not by the package)."""

from __future__ import annotations

from functools import cache

import torch

from fedmq.experiments.bench.flower_workload import Workload


@cache
def workload(path: str, torch_threads: int) -> Workload:
    """The workload, loaded once per app process (a simulation's actors and a deployment's app
    processes may serve many messages each): Flower's examples keep their dataset the same way."""
    if not path:
        raise ValueError("run config 'workload' is empty: pass --run-config 'workload=\"PATH.yaml\"'")
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    return Workload.from_file(path)
