"""Compressed updates at the coordinator: decoded before the schema check by both engines; another
compression than the configured one, or a malformed one, refused as bad-compression through the
normal path (a Refused, a receipt, the run goes on); a delta restored from the kept model of its
base version, in sync rounds (late updates carried included) and asynchronous FedBuff and FedAsync."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from fedmq.broker import Kind, Message
from fedmq.coordinator.compressed import DeltaPayload, restore
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.local import LocalFederation, LocalNode
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine import make_engine
from fedmq.coordinator.halfcalls import HalfCalls
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import Payload
from fedmq.fedcore.compression import SCALES, Compression, compress
from tests.algorithms.common import SETTINGS, context, scalar_model, shards, tiny_model
from tests.algorithms.common import update as node_update
from tests.coordinator.engine_helpers import Driver, config, of, one

NODES = ("a", "b", "c")
INT8 = Compression(mode="int8", delta=False)


def _config(compression: Compression, **kwargs: Any) -> CoordinatorConfig:
    return dataclasses.replace(config(**kwargs), compression=compression)


def compressed(
    spec: c.TaskSpec,
    compression: Compression,
    *,
    value: float = 1.0,
    base: float = 0.0,
    tamper: Callable[[dict[str, np.ndarray]], None] | None = None,
    meta: Any = None,
) -> e.UpdateArrived:
    """The update a node sends for `spec`: w = [value, -value / 2], compressed (as a change from a
    task model of `base` with delta), then `tamper`ed with; `meta` replaces its compression meta."""
    w = np.array([value, -value / 2], np.float32)
    tensors = compress({"model/w": w}, compression, base={"model/w": np.full(2, base, np.float32)})
    if tamper is not None:
        tamper(tensors)
    fields: dict[str, Any] = {"task": spec.task, "num_samples": 10, "train_seconds": 0.5, "base_version": spec.version}
    if meta is not None or compression.enabled:
        fields["compression"] = meta if meta is not None else compression.meta()
    message = Message(
        kind=Kind.UPDATE, federation="f", round=spec.round, sender=spec.node, meta=fields, tensors=tensors
    )
    return e.UpdateArrived(message, 0.0)


def _sync_round(d: Driver) -> dict[str, c.TaskSpec]:
    d.start(*NODES)
    configure = of(c.Configure, d.log)[-1]
    d.feed(e.Configured(configure.step, inline=True))
    return {t.node: t for t in configure.tasks}


@pytest.mark.parametrize("compression", [INT8, Compression(mode="float16", delta=False), Compression(mode="bfloat16")])
def test_sync_compressed_update_is_decoded_to_the_schema_and_aggregated(compression: Compression) -> None:
    """The engine's update holds the schema's float32 tensor, close to what the node trained."""
    d = Driver(_config(compression))
    tasks = _sync_round(d)
    for node in NODES:
        d.feed(compressed(tasks[node], compression))
    aggregate = one(c.Aggregate, d.log)
    assert len(aggregate.updates) == 3 and {r.status for r in of(c.Receipt, d.log)} == {"received"}
    for u in aggregate.updates:
        w = u.payload.tensors["model"]["w"]
        assert w.dtype == torch.float32 and w.shape == (2,)
        assert isinstance(u.payload, DeltaPayload) == compression.delta
        assert torch.allclose(w, torch.tensor([1.0, -0.5]), atol=1e-2)


def test_delta_update_is_restored_from_its_base_versions_model() -> None:
    """With delta, the accepted update is the change (0.25) until `restore` adds its version's model."""
    compression = Compression(mode="int8-block", block=8)
    d = Driver(_config(compression))
    tasks = _sync_round(d)
    d.feed(compressed(tasks["a"], compression, value=1.0, base=0.75))
    d.tick(10.0)
    update = one(c.Aggregate, d.log).updates[0]
    assert isinstance(update.payload, DeltaPayload)
    assert torch.allclose(update.payload.tensors["model"]["w"], torch.tensor([0.25, -1.25]), atol=1e-2)
    models = {0: {"w": torch.full((2,), 0.75)}}
    (whole,) = restore([update], models.__getitem__)
    assert type(whole.payload) is Payload
    assert torch.allclose(whole.payload.tensors["model"]["w"], torch.tensor([1.0, -0.5]), atol=1e-2)


CARRY = {"policy": {"late_updates": "carry"}, "max_staleness": 2}


@pytest.mark.parametrize(
    ("kwargs", "compression", "keeps", "keep_from"),
    [
        ({}, Compression(), False, 1),
        ({}, INT8, False, 1),
        ({}, Compression(mode="int8"), True, 1),
        (CARRY, Compression(mode="int8"), True, -1),
    ],
    ids=["uncompressed", "int8-weights", "int8-delta", "int8-delta-carry"],
)
def test_sync_engine_says_which_models_to_keep_and_from_which_version(
    kwargs: dict[str, Any], compression: Compression, keeps: bool, keep_from: int
) -> None:
    """Issue 30, item 4: the engine decides what the half's calls keep. A round's Configure asks for
    its model to be kept when the updates will be deltas from it; its Aggregate lets go of every
    version older than the next round's, or max_staleness before it while late updates are carried."""
    d = Driver(_config(compression, **kwargs))
    tasks = _sync_round(d)
    assert one(c.Configure, d.log).keep_model is keeps
    for node in NODES:
        d.feed(compressed(tasks[node], compression))
    assert one(c.Aggregate, d.log).keep_from == keep_from


@pytest.mark.parametrize(
    ("buffer", "compression", "keeps"),
    [(1, Compression(), False), (1, INT8, False), (1, Compression(mode="int8"), True), (2, Compression(), True)],
    ids=["fedasync", "fedasync-int8-weights", "fedasync-int8-delta", "fedbuff"],
)
def test_async_engine_says_which_models_to_keep(buffer: int, compression: Compression, keeps: bool) -> None:
    """Issue 30, item 4: an asynchronous task's model is kept when its update will be a delta from it
    or FedBuff (buffer above 1) folds the update as a delta from it; the Aggregate's keep_from (the
    oldest version a task in flight or a buffered update came from) lets it go."""
    d = Driver(_config(compression, engine="async", buffer=buffer, concurrency=3))
    d.start(*NODES)
    assert one(c.Configure, d.log).keep_model is keeps


def test_half_calls_keep_and_let_go_exactly_the_models_the_commands_say() -> None:
    """Issue 30, item 4: the half's calls derive nothing from the config. A Configure that asks for
    its model to be kept has it kept (uncompressed sync rounds never need one), one that does not
    ask has none kept, and an Aggregate lets go of the versions below its keep_from and of no other
    (None: of none, where late updates carried would once have made the calls work out their own)."""
    spec = get_algorithm("fedavg")
    half = spec.coordinator(build_hyperparams(spec, {}), model=scalar_model(0.5))
    calls = HalfCalls(half, _config(Compression(), **CARRY))

    def configure(version: int, keep: bool) -> None:
        ctx = dataclasses.replace(context(version, ("a",)), version=version)
        calls.configure(c.Configure(version, ctx, (), {}, 10.0, keep_model=keep))

    def aggregate(version: int, keep_from: int | None) -> list[int]:
        ctx = dataclasses.replace(context(version, ("a",)), version=version)
        update = node_update("a", {"weight": torch.full((1, 1), 0.5)}, 10, round=version)
        calls.aggregate(c.Aggregate(version, ctx, [update], [], keep_from=keep_from))
        return [v for v in range(10) if v in calls.versions._models]

    for version in range(4):
        configure(version, keep=version != 2)
    assert aggregate(3, None) == [0, 1, 3]
    assert aggregate(3, 1) == [1, 3]
    assert calls.versions.model(1)["weight"].item() == 0.5


def _scales(value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def tamper(tensors: dict[str, np.ndarray]) -> None:
        tensors[SCALES] = np.full_like(tensors[SCALES], value)

    return tamper


REFUSED: list[tuple[str, Compression, Compression, dict[str, Any], str]] = [
    ("uncompressed where int8 is expected", INT8, Compression(), {}, "the update is uncompressed"),
    ("float16 where int8 is expected", INT8, Compression(mode="float16", delta=False), {}, "float16(weights)"),
    ("int8 where none is expected", Compression(), INT8, {}, "this federation's are uncompressed"),
    ("delta where weights are expected", INT8, Compression(mode="int8"), {}, "int8(delta)"),
    ("another block size", Compression(mode="int8-block", block=64), Compression(mode="int8-block", block=128), {}, "int8-block(128"),
    ("a NaN scale", INT8, INT8, {"tamper": _scales(float("nan"))}, "finite"),
    ("a scale missing", INT8, INT8, {"tamper": lambda t: t.pop(SCALES)}, "without"),
    ("int8 data as float32", INT8, INT8, {"tamper": lambda t: t.update({"model/w": np.ones(2, np.float32)})}, "carries int8"),
    ("an unknown mode", INT8, INT8, {"meta": {"mode": "zip", "delta": False}}, "unknown compression mode"),
    ("meta that is not a map", INT8, INT8, {"meta": "int8"}, "not a map"),
]  # fmt: skip


@pytest.mark.parametrize("engine", ["sync", "async"])
@pytest.mark.parametrize(("what", "expected", "sent", "how", "detail"), REFUSED, ids=[r[0] for r in REFUSED])
def test_update_compressed_otherwise_or_malformed_is_refused_and_the_run_goes_on(
    engine: str, what: str, expected: Compression, sent: Compression, how: dict[str, Any], detail: str
) -> None:
    """Refused as bad-compression with the reason, the node told so; its next, valid update is taken."""
    cfg = _config(expected, engine=engine, buffer=2, concurrency=3) if engine == "async" else _config(expected)
    d = Driver(cfg)
    if engine == "sync":
        tasks = _sync_round(d)
    else:
        d.start(*NODES)
        configure = one(c.Configure, d.log)
        d.feed(e.Configured(configure.step, inline=True))
        tasks = {t.node: t for t in configure.tasks}
    out = d.feed(compressed(tasks["a"], sent, **how))
    refused = one(c.Refused, out)
    assert refused.reason == "bad-compression" and detail in refused.detail, refused.detail
    assert one(c.Receipt, out).status == "rejected" and d.engine.state == "running"
    if engine == "sync":  # the node may yet send a valid update for the round
        assert one(c.Receipt, d.feed(compressed(tasks["a"], expected))).status == "received"
    else:  # its task is over; another node's valid update is taken
        assert one(c.Receipt, d.feed(compressed(tasks["b"], expected))).status == "received"


def _federation(cfg: CoordinatorConfig, compute: dict[str, float] | None = None) -> LocalFederation:
    """FedAvg over three label-skewed shards on a tiny model (as tests/coordinator/test_local.py)."""
    spec = get_algorithm("fedavg")
    hp = build_hyperparams(spec, {})
    half = spec.coordinator(hp, model=tiny_model(0))
    names = ("node-000", "node-001", "node-002")
    nodes = {n: LocalNode(spec.node(hp, node_id=n), data) for n, data in zip(names, shards(), strict=True)}
    return LocalFederation(
        engine=make_engine(dataclasses.replace(cfg, train=SETTINGS), half.update_schema(), evaluates=False),
        half=half,
        nodes=nodes,
        workspace=tiny_model(99),
        compute_s=(lambda node, task: compute.get(node, 1.0)) if compute else None,
    )


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return sum(float((a[k].double() - b[k].double()).norm()) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rounds": 4},
        {"rounds": 6, "policy": {"deadline_s": 2.0, "late_updates": "carry"}, "max_staleness": 2},
        {"engine": "async", "buffer": 2, "concurrency": 3, "aggregations": 6},
        {"engine": "async", "buffer": 1, "concurrency": 3, "aggregations": 6},
    ],
    ids=["sync", "sync-late-carried", "fedbuff", "fedasync"],
)
def test_in_process_delta_compressed_run_keeps_only_the_models_it_needs_and_follows_the_plain_run(
    kwargs: dict[str, Any],
) -> None:
    """A run with int8 deltas folds every update (stragglers' late or stale ones included) into a model
    close to the uncompressed run's, and never keeps more than the versions an update may still need."""
    compute = {"node-002": 3.0}  # the slow node: late in sync (deadline 2 s), stale in async
    plain = _federation(_config(Compression(), **kwargs), compute)
    plain.run()
    fed = _federation(_config(Compression(mode="int8-block", block=16), **kwargs), compute)
    kept: list[int] = []
    calls = fed._half_calls  # what the driver keeps between aggregations
    aggregate = calls.aggregate
    calls.aggregate = lambda command: (aggregate(command), kept.append(len(calls.versions)))[0]  # type: ignore[method-assign]
    fed.run()
    assert fed.engine.state == "finished" and fed.refused == plain.refused and "bad-compression" not in fed.refused
    assert [r.get("folded", r.get("accepted")) for r in fed.records] == [
        r.get("folded", r.get("accepted")) for r in plain.records
    ]
    if "max_staleness" in kwargs:  # the slow node's updates came late and were carried
        assert any(r.get("late_folded") for r in fed.records)
    if kwargs.get("engine") == "async":  # and stale
        assert any(r["staleness_mean"] > 0 for r in fed.records)
    # after each aggregation: none in sync rounds (the next round's model is kept when it is sent), the
    # max_staleness versions a late update may lag, or the versions the async tasks in flight came from
    limit = 2 if "max_staleness" in kwargs else (4 if kwargs.get("engine") == "async" else 0)
    assert kept and max(kept) <= limit, kept
    gap = _distance(fed.model(), plain.model())
    assert 0 < gap < 0.02 * _distance(plain.model(), {k: torch.zeros_like(v) for k, v in plain.model().items()})


def test_in_process_per_node_models_with_delta_compression_fail_clearly() -> None:
    """A method that sends each node its own model cannot be read back from one kept model per version."""
    fed = _federation(_config(Compression(mode="int8"), rounds=2))
    configure = fed.half.configure_round

    def per_node(ctx: Any) -> dict[str, Payload]:
        payload = configure(ctx)
        other = {k: v + i for i, (k, v) in enumerate(payload.tensors["model"].items())}
        return {"node-000": payload, "node-001": Payload(tensors={"model": other}), "node-002": payload}

    fed.half.configure_round = per_node  # type: ignore[method-assign]
    with pytest.raises(Exception, match=r"compression\.delta false"):
        fed.run()
