"""The one workload the flower suite runs in fedmq and in Flower: fedmq's own pieces, step for step.

The workload is a fedmq experiment config (written as YAML and read by both sides). Flower's ClientApp
and ServerApp (`experiments/bench/flower_app/`) call `Workload`, which trains a node with fedmq's own
node half of the method (the same data shard, model, settings for the round and per-node generator
``torch_generator(seed, "node-train", node_id, round, attempt)`` as `fednode.trainer`), aggregates
with the method's own coordinator half (`experiments.build.coordinator_half`, as `fedmq run` builds
it) on the updates in node-id order (as the coordinator's engine hands them over), and evaluates the
global model on the test set as the coordinator does. So both frameworks compute the same FedAvg,
and their accuracy after each round should agree: the check that the comparison is fair. Nothing
here imports Flower, so it is tested without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from fedmq.experiments.build import coordinator_half, load_split, make_model, shards, train_settings
from fedmq.experiments.config import ExperimentConfig, load_config
from fedmq.fedcore.algorithms import base, build_hyperparams, get_algorithm
from fedmq.fedcore.data import Split
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.training import evaluate

StateDict = dict[str, torch.Tensor]

METHODS = ("fedavg", "noop")
"""What the suite compares: FedAvg, and no training at all (what a round costs the framework)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """The knobs of the comparison; everything else is fedmq's defaults."""

    dataset: str = "digits"
    data_root: str | None = None
    nodes: int = 10
    rounds: int = 5
    local_epochs: int = 1
    model: str = "mlp"
    hidden: tuple[int, ...] = (128,)
    method: str = "fedavg"
    seed: int = 0
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    alpha: float = 0.5
    """Dirichlet label skew of the partition."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r}: the flower suite compares {', '.join(METHODS)}")
        if self.nodes < 1 or self.rounds < 1 or self.local_epochs < 1:
            raise ValueError("nodes, rounds and local_epochs must be at least 1")


def shared_data_root() -> Path | None:
    """FEDMQ_DATA_ROOT, else the shared datasets next to the checkout (``../shared/data``), if present."""
    root = Path(os.environ.get("FEDMQ_DATA_ROOT") or Path(__file__).resolve().parents[3] / "shared" / "data")
    return root if root.is_dir() else None


def mnist_available(root: Path | None) -> bool:
    return root is not None and any((root / sub).is_dir() for sub in ("mnist/MNIST/raw", "MNIST/raw"))


def experiment(spec: WorkloadSpec, name: str) -> ExperimentConfig:
    """The fedmq experiment for `spec`: every node trains every round (C = 1), no deadline is hit."""
    model: dict[str, Any] = {"name": spec.model}
    if spec.model == "mlp":
        model["options"] = {"hidden": list(spec.hidden)}
    data: dict[str, Any] = {"dataset": spec.dataset}
    if spec.data_root:
        data["root"] = spec.data_root
    return ExperimentConfig.model_validate(
        {
            "name": name,
            "seed": spec.seed,
            "nodes": spec.nodes,
            "rounds": spec.rounds,
            "eval_every": 1,
            "policy": {"fraction": 1.0, "deadline_s": 600},
            "data": data,
            "partition": {"kind": "dirichlet", "alpha": spec.alpha, "min_samples": 10},
            "model": model,
            "method": {"name": spec.method},
            "train": {
                "local_epochs": spec.local_epochs,
                "batch_size": spec.batch_size,
                "optimizer": "sgd",
                "lr": spec.lr,
                "momentum": spec.momentum,
            },
        }
    )


@dataclass(frozen=True, slots=True)
class NodeResult:
    node_id: str
    state: StateDict
    """A copy: it does not alias the workspace model, which the next node trains in."""
    num_samples: int
    loss: float


class Workload:
    """One process's view of the workload (a Flower ClientApp's or ServerApp's, or a test's): the data
    is loaded once and one model is trained in by the nodes in turn, as in a fedmq node host."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        self.spec = get_algorithm(cfg.method.name)
        self.hp = build_hyperparams(self.spec, cfg.method.hyperparams)
        self.node_ids = cfg.node_ids()
        self._halves: dict[str, base.NodeHalf] = {}

    @classmethod
    def from_file(cls, path: str | Path) -> Workload:
        return cls(load_config(path))

    @cached_property
    def split(self) -> Split:
        return load_split(self.cfg)

    @cached_property
    def parts(self) -> dict[str, Any]:
        return shards(self.cfg, self.split)

    @cached_property
    def workspace_model(self) -> torch.nn.Module:
        return make_model(self.cfg, self.split.train)

    @cached_property
    def eval_model(self) -> torch.nn.Module:
        return make_model(self.cfg, self.split.test)

    @cached_property
    def coordinator(self) -> base.CoordinatorHalf:
        """The method's coordinator half, as `fedmq run` builds it (its model is the last aggregate)."""
        return coordinator_half(self.cfg, self.split)

    def node_id(self, partition: int) -> str:
        """Flower's partition id (0 .. nodes-1) -> fedmq's node id."""
        if not 0 <= partition < len(self.node_ids):
            raise ValueError(f"partition {partition} is outside 0 .. {len(self.node_ids) - 1}")
        return self.node_ids[partition]

    def initial_state(self) -> StateDict:
        """The global model of round 0: the coordinator's initialisation (seeded by the run's seed)."""
        return {k: v.clone() for k, v in self.eval_model.state_dict().items()}

    def train(self, node_id: str, state: StateDict, round: int, attempt: int = 0) -> NodeResult:
        """What fedmq's node daemon does for a task of `round` (0-based): the method's node half on the
        node's shard, with the round's settings and the node's generator for (round, attempt)."""
        half = self._halves.get(node_id)
        if half is None:
            half = self._halves[node_id] = self.spec.node(self.hp, node_id=node_id)
        data = self.split.train.subset(self.parts[node_id])
        task = base.TaskInput(
            node_id=node_id,
            round=round,
            payload=base.Payload(tensors={"model": state}),
            settings=train_settings(self.cfg).for_round(round),
        )
        generator = torch_generator(self.cfg.seed, "node-train", node_id, round, attempt)
        payload = half.train(task, self.workspace_model, data, generator)
        loss = float(payload.meta.get("loss", float("nan")))
        copied = {k: v.detach().clone() for k, v in payload.tensors["model"].items()}
        return NodeResult(node_id, copied, len(data), loss)

    def aggregate(self, results: Sequence[NodeResult], round: int = 0) -> StateDict:
        """The method's server step for `round` (0-based) as fedmq's coordinator takes it: its half's
        `aggregate` on the updates sorted by node id (FedAvg: weighted by shard size)."""
        if not results:
            raise ValueError("no node results to aggregate")
        ordered = sorted(results, key=lambda r: r.node_id)
        updates = [
            base.NodeUpdate(
                node_id=r.node_id,
                round=round,
                num_samples=r.num_samples,
                payload=base.Payload(tensors={"model": r.state}, meta={"loss": r.loss}),
            )
            for r in ordered
        ]
        ctx = base.RoundContext(
            round=round,
            selected=tuple(r.node_id for r in ordered),
            participation=ParticipationRecord(),
            settings=train_settings(self.cfg).for_round(round),
            generator=torch_generator(self.cfg.seed, "coordinator", "aggregate", round),
        )
        self.coordinator.aggregate(ctx, updates, [])
        return {k: v.detach().clone() for k, v in self.coordinator.model.state_dict().items()}

    def evaluate(self, state: StateDict) -> tuple[float, float]:
        """(test accuracy, test loss) of the global model, as the coordinator evaluates it."""
        self.eval_model.load_state_dict(state)
        return evaluate(self.eval_model, self.split.test)
