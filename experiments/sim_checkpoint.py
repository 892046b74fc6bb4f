"""Checkpoints of a simulated run, and `fedmq simulate --resume` from them.

A simulated run is resumed exactly (the same final model, bit for bit, and the same metrics lines as
a run never cut) only from a moment the daemons' checkpoint format can describe: the end of a round,
when the engine emits its `Checkpoint` command, with no update in flight and no task waiting to be
trained. At such a moment the whole simulation is the daemon's checkpoint (the global model, the
coordinator half's state and the engine's meta, in the same safetensors file, `coordinator.storage.run_dir`)
plus what only a simulation has, kept under the meta's ``"simulation"`` key and ``node/`` tensors:

- the virtual clock, and the scenario's availability changes still to come;
- every node half's own state (SCAFFOLD's control variate, MOON's previous model, ...), which the
  node daemon never persists (a restarted node starts afresh, a simulation must not);
- how many task ids were drawn from the run's id stream, how many tasks each scripted node was given
  (its drops are counted per task), and the counters the summary reports;
- the few engine fields its own meta leaves out because a restarted daemon measures them anew (when
  the run started, refusals), so that the metrics' ``ended_s`` continue as in an uncut run.

A round that ends with an update still in flight (a straggler past the deadline) is not a resumable
moment: its checkpoint waits for the next round that ends clean. An engine that always has tasks in
flight (``engine.kind: async``) therefore never checkpoints, and `--resume` refuses it, as it refuses
the other settings whose state would not survive (`resume_refusal`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedmq.coordinator.drivers.local import LocalFederation
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.experiments.config import ExperimentConfig
from fedmq.fedcore.algorithms.base import NodeHalf
from fedmq.fedcore.errors import ConfigError

logger = logging.getLogger(__name__)

NODE_PREFIX = "node/"
"""Checkpoint tensors of the node halves' state: ``node/<node id>/<leaf>``."""

NOT_STATE = ("hp", "node_id")
"""A node half's attributes its constructor sets from the config: rebuilt, not saved."""


class ResumeError(ConfigError):
    """A simulated run cannot be resumed (or checkpointed) exactly; the message says what to do."""


def resume_refusal(cfg: ExperimentConfig) -> str | None:
    """Why `cfg`'s simulated run cannot be resumed exactly, or None when it can."""
    if cfg.engine.kind == "async":
        return (
            "engine.kind async always has tasks in flight, and a simulation resumes only from a round's end"
            " with nothing in flight; run it again without --resume"
        )
    if cfg.hierarchy.sites:
        return "hierarchy: a simulated run with site aggregators cannot be resumed yet; run it without --resume"
    if cfg.policy.late_updates == "carry":
        return (
            "policy.late_updates carry: late updates carried into the next round are not in the checkpoint;"
            " run it without --resume"
        )
    hyperparams = cfg.method.hyperparams or {}
    if cfg.method.name == "kdia" and hyperparams.get("store") == "disk" and not hyperparams.get("store_dir"):
        return (
            "kdia with store disk and no store_dir keeps its models in a temporary directory that a resumed run"
            " does not find; set method.hyperparams.store_dir, or run without --resume"
        )
    return None


# -- node halves' state --------------------------------------------------------------------------


def encode_node_state(half: NodeHalf) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The half's attributes as a JSON skeleton and its tensors (keyed by the skeleton's ``$t``).

    Generic, because no method declares its node state: tensors, plain values and dicts, lists and
    tuples of them are kept; anything else (a module, a generator) is a `ResumeError` naming it."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = str(len(tensors))
            tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            return {"$t": key, "device": str(value.device), "grad": value.requires_grad}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"$d": {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
        if isinstance(value, list | tuple):
            items = [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return {"$l" if isinstance(value, list) else "$u": items}
        raise ResumeError(
            f"{type(half).__name__}.{where} holds a {type(value).__name__}, which a simulation checkpoint cannot"
            " keep; set simulation.checkpoint_every: 0 and run without --resume"
        )

    try:
        attributes = vars(half)
    except TypeError:
        raise ResumeError(f"{type(half).__name__} keeps its state in slots; a checkpoint cannot read it") from None
    skeleton = {name: encode(value, name) for name, value in attributes.items() if name not in NOT_STATE}
    return skeleton, tensors


def decode_node_state(half: NodeHalf, skeleton: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Set the half's attributes from `encode_node_state`'s output (tensors back on their devices)."""

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if "$t" in value:
            tensor = tensors[value["$t"]].to(value["device"])
            return tensor.requires_grad_(True) if value["grad"] else tensor
        if "$d" in value:
            return {k: decode(v) for k, v in value["$d"].items()}
        if "$l" in value:
            return [decode(v) for v in value["$l"]]
        return tuple(decode(v) for v in value["$u"])

    for name, value in skeleton.items():
        setattr(half, name, decode(value))


# -- the federation --------------------------------------------------------------------------------


class CountedIds:
    """The run's task-id stream, counting its draws (a resumed run skips as many)."""

    def __init__(self, new_id: Callable[[], bytes], drawn: int = 0) -> None:
        self.new_id = new_id
        self.drawn = drawn

    def __call__(self) -> bytes:
        self.drawn += 1
        return self.new_id()


@dataclass
class CheckpointedFederation(LocalFederation):
    """A `LocalFederation` that hands each resumable checkpoint to `on_checkpoint`.

    It only watches the engine's `Checkpoint` commands and the events around them; how nodes train
    is the parent's."""

    on_checkpoint: Callable[[c.Checkpoint, Mapping[str, Any]], None] | None = None
    """Called with the command and the simulation's own state, at a resumable round end."""
    checkpoint_every: int = 0
    ids: CountedIds | None = None
    restored_engine: Mapping[str, Any] | None = None
    """Engine fields a resumed run sets back once its engine has handled Start (`restore_simulation`)."""
    task_counts: Counter[str] | None = None
    """Tasks given to each scripted node so far (`experiments.simulate.ScriptedCompute.counts`)."""
    _ids_before: int = field(default=0, init=False)
    _last_checkpoint: int | None = field(default=None, init=False)

    def before_event(self, event: e.Event) -> None:
        # a round's end and the next round's start are one engine step: the id drawn for the next
        # round is not the checkpoint's, so the count is taken before the step
        self._ids_before = self.ids.drawn if self.ids is not None else 0

    def after_event(self, event: e.Event) -> None:
        if isinstance(event, e.Start) and self.restored_engine is not None:
            self._restore_engine_fields(self.restored_engine)
            self.restored_engine = None

    def after_command(self, command: c.Command) -> None:
        if isinstance(command, c.Checkpoint) and self.on_checkpoint is not None and self._due(command):
            moment = self.simulation_state()
            if moment is None:
                return
            try:
                self.on_checkpoint(command, moment)
            except ResumeError as exc:  # a run that was never to be resumed must not fail for it
                logger.warning("no more checkpoints in this run (--resume would start it afresh): %s", exc)
                self.checkpoint_every = 0
            else:
                self._last_checkpoint = command.key

    def _due(self, command: c.Checkpoint) -> bool:
        """Every `checkpoint_every` rounds, counted from the last checkpoint taken (a round ending
        with updates in flight puts it off). Not at the end: a run cut after its last round resumes
        from the checkpoint before and evaluates its last round again, where the final model's
        choice (`Evaluator.final_model`) is made."""
        if self.checkpoint_every <= 0 or self.engine.finished:
            return False
        last = self._last_checkpoint if self._last_checkpoint is not None else -1
        return command.key - last >= self.checkpoint_every

    def note_checkpoint(self, key: int) -> None:
        """The run resumes from the checkpoint of round `key`: the next is due `checkpoint_every` later."""
        self._last_checkpoint = key

    def simulation_state(self) -> dict[str, Any] | None:
        """What the simulation adds to the engine's meta, or None when this is no resumable moment
        (an update in flight, a task not yet trained, an event other than availability pending)."""
        pending = self.pending_availability()
        now = self.clock.now()
        if pending is None or any(when <= now for when, _, _ in pending):
            return None
        engine = self.engine
        if len(engine.live) < engine.policy.min_nodes:
            return None  # a resumed engine would wait for min_nodes where this one goes on
        return {
            "clock": now,
            "pending": [[when, node, online] for when, node, online in pending],
            "online": sorted(engine.live),
            "task_ids": self._ids_before,
            "task_counts": dict(self.task_counts or {}),
            "dropped": self.dropped,
            "lost_in_flight": self.lost_in_flight,
            "refused": dict(self.refused),
            "engine": {
                "started_at": engine.started_at,
                "startup_s": engine.startup_s,
                "refused": dict(engine.refused),
                "late_arrivals": engine.late_arrivals,
            },
        }

    def _restore_engine_fields(self, fields: Mapping[str, Any]) -> None:
        """What a restarted daemon measures anew, set back after the resumed engine's Start."""
        self.engine.started_at = fields["started_at"]
        self.engine.startup_s = fields["startup_s"]
        self.engine.refused = Counter(fields["refused"])
        self.engine.late_arrivals = int(fields["late_arrivals"])


# -- writing and reading ---------------------------------------------------------------------------


def save(run_dir: RunDir, fed: CheckpointedFederation, command: c.Checkpoint, moment: Mapping[str, Any]) -> None:
    """The daemon's checkpoint (model, half state, engine meta, participation.json) plus the simulation's."""
    tensors = Persistence(run_dir, fed.half).snapshot()
    nodes: dict[str, Any] = {}
    for node, local in fed.nodes.items():
        skeleton, leaves = encode_node_state(local.half)
        if skeleton:
            nodes[node] = skeleton
        tensors |= {f"{NODE_PREFIX}{node}/{k}": v for k, v in leaves.items()}
    meta = {**command.meta, "simulation": {**moment, "nodes": nodes}}
    run_dir.save_checkpoint(tensors, meta)
    run_dir.write_json("participation.json", meta["participation"])


def load(run_dir: RunDir, fed: LocalFederation) -> dict[str, Any] | None:
    """The checkpoint's meta, its model and half state loaded into `fed`'s half (the daemon's checks:
    the same federation, seed and engine); None when there is none."""
    config = fed.engine.config
    meta = Persistence(run_dir, fed.half).resume(federation=config.federation, seed=config.seed, engine=config.engine)
    if meta is None:
        return None
    if not isinstance(meta.get("simulation"), dict):
        raise ResumeError(
            f"the checkpoint in {run_dir.root} was written by a daemon, not by fedmq simulate; resume it with"
            " fedmq coordinator --resume, or use another --out"
        )
    return meta


def restore_simulation(fed: CheckpointedFederation, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """Put `fed` (freshly built, its half already loaded by `load`) where the checkpoint left the run."""
    sim = meta["simulation"]
    try:
        fed.engine.restore(meta)
    except (ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"the checkpoint does not match this experiment: {exc}") from exc
    fed.clock.set(float(sim["clock"]))
    fed.replace_schedule(
        [(float(when), e.NodeSeen(node, bool(online))) for when, node, online in sim["pending"]]
        + [(float(sim["clock"]), e.NodeSeen(node, False)) for node in fed.nodes if node not in set(sim["online"])]
    )
    for node, skeleton in sim["nodes"].items():
        prefix = f"{NODE_PREFIX}{node}/"
        leaves = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        decode_node_state(fed.nodes[node].half, skeleton, leaves)
    if fed.task_counts is not None:
        fed.task_counts.clear()
        fed.task_counts.update(sim["task_counts"])
    fed.dropped = int(sim["dropped"])
    fed.lost_in_flight = int(sim["lost_in_flight"])
    fed.refused = Counter(sim["refused"])
    fed.restored_engine = sim["engine"]
