"""An experiment file run in this process on the engine's in-process driver: no broker, virtual time.

The same data, shards, models, halves, settings and seeds as `fedmq run` builds for the daemons
(`experiments.build`), so a run whose outcome does not depend on timing (everyone answers before
every deadline) gives the daemons' figures round for round. Per-node compute times are virtual
seconds: the experiment's fault delays by default, or any `ComputeTime` given (the async
benchmark's heterogeneous speeds).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedmq.coordinator.drivers.local import ComputeTime, LocalFederation, LocalNode
from fedmq.coordinator.engine import make_engine
from fedmq.coordinator.engine.commands import TaskSpec
from fedmq.coordinator.halfcalls import update_schema
from fedmq.coordinator.observers.reporting import Evaluator
from fedmq.coordinator.storage.eventlog import EventLog
from fedmq.experiments.build import (
    coordinator_config,
    coordinator_half,
    load_split,
    make_model,
    node_faults,
    sample_limits,
    shards,
)
from fedmq.experiments.config import ExperimentConfig
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.host_memory import set_host_memory
from fedmq.fedcore.seeding import cudnn_kernels, stream
from fedmq.fedcore.training import best_device
from fedmq.fednode.workspace import Workspace


def fault_delays(cfg: ExperimentConfig) -> ComputeTime:
    """The delays the experiment's `faults` inject (`Faults.delay_for`, as the node daemon holds them) as
    virtual compute times (0 for everyone else)."""
    faults = {node: node_faults(cfg, node) for node in cfg.faults}

    def compute(node: str, task: TaskSpec) -> float:
        fault = faults.get(node)
        return fault.delay_for(task.round) if fault is not None else 0.0

    return compute


def seeded_ids(seed: int, *, skip: int = 0) -> Callable[[], bytes]:
    """Task ids drawn from the run's seed: an in-process run's event log is the same every time.
    `skip`: the ids a resumed run's first part drew already (it goes on with the next)."""
    ids = stream(seed, "task-ids")
    for _ in range(skip):
        ids.bytes(16)
    return lambda: ids.bytes(16)


def build_local(
    cfg: ExperimentConfig,
    *,
    compute_s: ComputeTime | None = None,
    device: torch.device | None = None,
    eval_device: str | None = None,
    event_log: EventLog | None = None,
    kind: type[LocalFederation] = LocalFederation,
    **extra: Any,
) -> LocalFederation:
    """The experiment as a `LocalFederation` (or `kind`, given `extra` fields); `run()` it. Crash
    and error faults are not simulated; a scenario's are (`experiments.simulate`)."""
    set_host_memory(cfg.simulation.host_memory)  # before the data: the process's whole heap is kept
    spec = get_algorithm(cfg.method.name)
    hp = build_hyperparams(spec, cfg.method.hyperparams)
    split = load_split(cfg)
    parts = shards(cfg, split)
    device = device or best_device()
    half = coordinator_half(cfg, split)
    config = coordinator_config(cfg, Path("."), node_samples=sample_limits(cfg, split))
    workspace = Workspace(make_model(cfg, split.train), device)
    nodes = {
        node: LocalNode(spec.node(hp, node_id=node), split.train.subset(parts[node]).to(device))
        for node in cfg.node_ids()
    }
    new_id = seeded_ids(cfg.seed)
    # last, over the deterministic algorithms the workspace and the half asked for: torch's flags are the
    # process's, so the coordinator's half (on the best device) follows the setting with the nodes
    cudnn_kernels(device if device.type == "cuda" else best_device(), cfg.simulation.cudnn)
    return kind(
        engine=make_engine(
            config,
            update_schema(half, config),
            evaluates=True,
            new_id=event_log.recording(new_id) if event_log is not None else new_id,
        ),
        half=half,
        nodes=nodes,
        workspace=workspace.model,
        seed=cfg.seed,
        evaluate=Evaluator(half, split.test, split.val, eval_device or config.eval_device),
        compute_s=compute_s or fault_delays(cfg),
        scratch=workspace.scratch,
        event_log=event_log,
        vectorize=cfg.simulation.vectorizes(device.type) and cfg.privacy.mechanism != "node",  # no per-sample clips
        graphs=cfg.simulation.graph_mode(),
        pipeline=cfg.simulation.pipeline_mode(),
        outputs_ahead=cfg.simulation.outputs_ahead_mode(),
        reuse_rounds=cfg.simulation.reuse_rounds,
        **extra,
    )
