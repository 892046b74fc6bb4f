"""Driving an engine by hand in tests: a fake clock, deterministic task ids, synthetic updates."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from fedmq.broker import Kind, Message
from fedmq.coordinator.config import AsyncPolicy, CoordinatorConfig, RoundPolicy
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine import make_engine
from fedmq.coordinator.engine.base import Engine
from fedmq.coordinator.engine.clock import FakeClock
from fedmq.fedcore.staleness import Staleness
from fedmq.fedcore.tensors import TensorSpec

SCHEMA = {"model": {"w": TensorSpec(torch.float32, (2,))}}
SAMPLES = 100
"""What every node announces unless a test says otherwise (`update` claims 10 by default)."""
C = TypeVar("C")


def config(
    *, rounds: int = 3, engine: str = "sync", policy: dict[str, Any] | None = None, **asynchronous: Any
) -> CoordinatorConfig:
    """A small federation's settings: everything the engines read, nothing else."""
    if isinstance(asynchronous.get("staleness"), dict):
        asynchronous["staleness"] = Staleness(**asynchronous["staleness"])
    base = RoundPolicy(fraction=1.0, deadline_s=10.0, ack_timeout_s=1.0, min_nodes=1, wait_for_nodes_s=30.0)
    return CoordinatorConfig(
        federation="f",
        rounds=rounds,
        seed=0,
        policy=replace(base, **(policy or {})),
        engine=engine,  # type: ignore[arg-type]
        asynchronous=AsyncPolicy(**asynchronous) if asynchronous else AsyncPolicy(),
    )


class Driver:
    """An engine, a fake clock and every command it gave, in order."""

    def __init__(self, cfg: CoordinatorConfig, *, evaluates: bool = True) -> None:
        ids = itertools.count()
        self.engine: Engine = make_engine(
            cfg, SCHEMA, evaluates=evaluates, new_id=lambda: next(ids).to_bytes(16, "big")
        )
        self.clock = FakeClock()
        self.log: list[c.Command] = []

    def feed(self, event: e.Event, *, at: float | None = None) -> list[c.Command]:
        if at is not None:
            self.clock.set(at)
        out = self.engine.handle(event, self.clock.now())
        self.log.extend(out)
        return out

    def start(self, *nodes: str, samples: int | None = SAMPLES) -> list[c.Command]:
        """`nodes` come online announcing `samples` (their retained statuses arrive first), then the run starts."""
        out = []
        for node in nodes:
            out += self.feed(seen(node, samples=samples))
        return out + self.feed(e.Start())

    def tick(self, at: float) -> list[c.Command]:
        return self.feed(e.Tick(), at=at)


def seen(node: str, online: bool = True, *, samples: int | None = SAMPLES) -> e.NodeSeen:
    """A node's status: online (announcing `samples`) or offline."""
    return e.NodeSeen(node, online, samples)


def of(kind: type[C], commands: Iterable[c.Command]) -> list[C]:
    return [x for x in commands if isinstance(x, kind)]


def one(kind: type[C], commands: Iterable[c.Command]) -> C:
    found = of(kind, commands)
    assert len(found) == 1, f"expected one {kind.__name__} in {commands}"
    return found[0]


def update(
    spec: c.TaskSpec, *, value: float = 1.0, samples: int = 10, base_version: int | None = -1, **meta: Any
) -> e.UpdateArrived:
    """The update a node sends for `spec` (its base_version the task's unless given; None: left out)."""
    fields: dict[str, Any] = {"task": spec.task, "num_samples": samples, "train_seconds": 0.5, **meta}
    if base_version is not None:
        fields["base_version"] = spec.version if base_version == -1 else base_version
    message = Message(
        kind=Kind.UPDATE,
        federation="f",
        round=spec.round,
        sender=spec.node,
        meta=fields,
        tensors={"model/w": np.full(2, value, np.float32)},
    )
    return e.UpdateArrived(message, 0.0)


def failure(spec: c.TaskSpec, reason: str = "out of memory") -> e.UpdateArrived:
    message = Message(
        kind=Kind.UPDATE, federation="f", round=spec.round, sender=spec.node, meta={"task": spec.task, "failed": reason}
    )
    return e.UpdateArrived(message, 0.0)
