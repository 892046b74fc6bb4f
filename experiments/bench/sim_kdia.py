"""KDIA's node training vectorised, beside FedAvg's on the same workload.

The GPU target of issue 28 is a KDIA cell (kdia-beta01.yaml: 200 rounds of about 50,000 node-training
images) in 3 minutes. The suite's main cases time FedAvg's objective on KDIA's workload (the MOON CNN,
CIFAR-shaped uint8 images, crop and flip, batch 64); a KDIA round also runs, at every step, the
teacher's forward pass (a frozen model the nodes share) and the head on the frozen generator's
features, with its KL and cross-entropy terms. This section of `fedmq bench sim` trains KDIA's nodes as
its cells do (`kdia.NodeHalf.train_group`: the teacher and generator are untrained MOON-CNN and
generator weights, as their values do not change the work) beside FedAvg's objective on the same
shards: a round's images a second (on a GPU with rounds kept, as `simulation.reuse_rounds` keeps them),
each step's operators and memory traffic (`step_cost`), and what a KDIA cell's node training would take
at that speed (arithmetic on the figure, said so, not timed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from fedmq.experiments.bench.common import Report, Timing, measure
from fedmq.experiments.bench.sim_batch_norm import add_path_rows
from fedmq.experiments.bench.simulator import Case, KeptRounds, vectorised, workload
from fedmq.experiments.bench.step_cost import StepCost, last_step_cost
from fedmq.experiments.bench.training import synchronized
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import GroupMember, Payload, TaskInput
from fedmq.fedcore.algorithms.kdia.generator import build_generator
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import FedModel, build_model
from fedmq.fedcore.seeding import torch_generator

HYPERPARAMS = {"lambda_kd": 0.5, "lambda_gen": 0.01, "kd_direction": "reverse", "noise_dim": 100}
"""kdia-beta01.yaml's KDIA (the authors' code's reverse KL); the generator's own training is not timed here
(`sim_generator` times it)."""
CELL_ROUNDS, CELL_IMAGES = 200, 50_000
"""A paper-scale KDIA cell: 200 rounds of about 10 nodes x 500 images x 10 epochs."""

KDIA = "KDIA's objective, vectorised"
FEDAVG = "FedAvg's objective, vectorised"


def kdia_round(model: nn.Module, datasets: Sequence[TensorDataset], case: Case) -> Callable[[], object]:
    """A round of KDIA's vectorised node training of `datasets`, every node distilling from one teacher and
    learning from the generator's features, as a cell's group of nodes trains (`train_group`)."""
    spec = get_algorithm("kdia")
    hp = build_hyperparams(spec, dict(HYPERPARAMS))
    shape, classes = datasets[0].input_shape, datasets[0].num_classes
    device = next(model.parameters()).device
    teacher = build_model("moon-cnn", shape, classes, seed=9)
    tensors = {
        "model": model.state_dict(),
        "teacher": teacher.state_dict(),
        "generator": build_generator(hp.noise_dim, cast(FedModel, teacher)).state_dict(),
    }
    payload = Payload(tensors=tensors, meta={"distill": True, "generate": True})
    spares: dict[str, nn.Module] = {}

    def spare(key: str, build: Any = None) -> nn.Module:
        """The node's workspace of spare models (the teacher's, the generator), kept from round to round."""
        if key not in spares:
            spares[key] = (build() if build is not None else build_model("moon-cnn", shape, classes, seed=0)).to(device)
        return spares[key]

    def call() -> object:
        members = [
            GroupMember(
                half=spec.node(hp, node_id=f"node-{i}"),
                task=TaskInput(node_id=f"node-{i}", round=1, payload=payload, settings=case.settings, scratch=spare),
                data=data,
                generator=torch_generator(0, "node-train", f"node-{i}", 1),
            )
            for i, data in enumerate(datasets)
        ]
        return members[0].half.train_group(members, model)

    return call


def step_costs(case: Case, device: torch.device) -> dict[str, StepCost]:
    """The last step of a KDIA round and of a FedAvg round on the same shards (eager)."""
    model, datasets = workload(case, device)
    return {
        KDIA: last_step_cost(kdia_round(model, datasets, case)),
        FEDAVG: last_step_cost(vectorised(model, datasets, case, graphs="off")),
    }


def timings(case: Case, device: torch.device, repeats: int) -> dict[str, Timing]:
    model, datasets = workload(case, device)
    kept = device.type == "cuda"
    paths: dict[str, Callable[[], object]] = {
        KDIA: kdia_round(model, datasets, case),
        FEDAVG: vectorised(model, datasets, case),
    }
    if kept:
        paths = {name: KeptRounds(call) for name, call in paths.items()}
    return {name: measure(synchronized(call, device), repeats=repeats, warmup=1) for name, call in paths.items()}


def add_rows(report: Report, device: torch.device, repeats: int, quick: bool) -> None:
    """Each objective's round as images a second against FedAvg's, a KDIA cell's node training at KDIA's
    speed (arithmetic; the generator's own rounds apart), then each step's operators and memory traffic
    against FedAvg's."""
    case = Case(3, 128, 1) if quick else Case(10, 448, 1)
    gpu = device.type == "cuda"
    section = f"KDIA's node objective against FedAvg's: {case.label}, {device}" + (", rounds kept" if gpu else "")
    times = timings(case, device, repeats)
    images = case.k * case.size * case.epochs
    cell = ("KDIA", CELL_ROUNDS, CELL_IMAGES, (KDIA,))
    add_path_rows(report, images, times, step_costs(case, device), FEDAVG, cell, section, whose="FedAvg's")
