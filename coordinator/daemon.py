"""The coordinator daemon: drives synchronous rounds over the bus with an algorithm's coordinator half.

One `Coordinator` composes a `BusClient`, a `NodeRegistry`, the `ParticipationRecord`, a run
directory and the algorithm half. Two loops run in one TaskGroup: the receiver, which validates and
routes every incoming message (and never dies of one), and the driver, which runs the rounds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from broker import BusClient, BusConfig, Envelope, Kind, Message, Topics, Will, encode
from broker.codec import encoded_size
from broker.errors import BusError
from coordinator.checkpoints import CheckpointWriter
from coordinator.config import CoordinatorConfig
from coordinator.errors import CoordinatorError, ProtocolError
from coordinator.registry import NodeRegistry
from coordinator.rounds import RoundOutcome, RoundState
from coordinator.run_dir import RunDir
from coordinator.sampler import sample
from coordinator.updates import parse_update
from fedcore.algorithms.base import CoordinatorHalf, Failure, RoundContext
from fedcore.data import TensorDataset
from fedcore.participation import ParticipationRecord
from fedcore.seeding import torch_generator
from fedcore.tensors import flatten_groups
from fedcore.training import evaluate

logger = logging.getLogger(__name__)

SENDER = "coordinator"
_PAST_ROUNDS_KEPT = 64


@dataclass(frozen=True, slots=True)
class Summary:
    rounds_completed: int
    final_accuracy: float | None
    best_accuracy: float | None
    wall_seconds: float
    state: str


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        bus_config: BusConfig,
        half: CoordinatorHalf,
        test_data: TensorDataset | None = None,
        *,
        val_data: TensorDataset | None = None,
        extra_summary: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.bus_config = bus_config
        self.half = half
        self.test_data = test_data
        self.val_data = val_data
        self.last_models: dict[str, dict[str, float]] = {}
        self.topics = Topics(config.federation)
        self.registry = NodeRegistry()
        self.participation = ParticipationRecord()
        self.run_dir = RunDir(config.out_dir)
        self.run_id = os.urandom(8).hex()
        self.round = 0
        self.model_version = 0
        self.rounds_completed = 0
        self.accuracies: list[tuple[int, float]] = []
        self.late_arrivals = 0
        self.current: RoundState | None = None
        self._past: deque[RoundState] = deque(maxlen=_PAST_ROUNDS_KEPT)
        self._model_frame: bytearray | None = None
        self._checkpoints = CheckpointWriter()
        self._published_state: str | None = None
        self._startup_s: float | None = None
        """Seconds from start until min_nodes nodes were live and round 0 began."""
        self._background: set[asyncio.Task[Any]] = set()
        self._bus: BusClient | None = None
        self._extra_summary = dict(extra_summary or {})
        self._started = time.monotonic()
        self._state = "starting"

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> Summary:
        """Run every round, then publish 'finished'. Cancelling it stops after writing the summary."""
        self._started = time.monotonic()
        if self.config.resume:
            self._resume()
        will = Will(self.topics.coordinator_status, self._status_message("offline"))
        client = BusClient(
            self.bus_config,
            client_id=f"{self.config.federation}-coordinator",
            federation=self.config.federation,
            will=will,
            logger=logger.getChild("bus"),
        )
        async with client as bus:
            self._bus = bus
            await bus.subscribe(self.topics.all_node_status, self.topics.all_acks, self.topics.all_updates)
            receiver = asyncio.create_task(self._receive(bus), name="coordinator-receive")
            driver = asyncio.create_task(self._drive(), name="coordinator-drive")
            try:
                await asyncio.wait({receiver, driver}, return_when=asyncio.FIRST_COMPLETED)
                if driver.done():
                    driver.result()
                    self._state = "finished"
                else:
                    receiver.result()  # the receiver only ends when the bus gives up
                    raise CoordinatorError("the message receiver stopped")
            except asyncio.CancelledError:
                self._state = "stopped"
                raise
            except (CoordinatorError, BusError) as exc:
                self._state = "failed"
                logger.error("%s", exc)
            finally:
                for task in (receiver, driver, *self._background):
                    task.cancel()
                await asyncio.gather(receiver, driver, return_exceptions=True)
                await self._checkpoints.flush()  # the last round's checkpoint is on disk before exit
                summary = self._write_summary()
                await asyncio.shield(self._publish_status_quietly(self._state))
        return summary

    # -- receiving -------------------------------------------------------------------------

    async def _receive(self, bus: BusClient) -> None:
        async for envelope in bus.messages():
            try:
                await self._dispatch(envelope)
            except ProtocolError as exc:
                bus.reject(exc.reason, envelope, exc.detail)
                if exc.reason not in ("duplicate-update", "wrong-round", "not-selected", "wrong-sender"):
                    self._receipt_soon(envelope.message, "rejected", exc.reason)
            except Exception:  # a daemon never dies of one message; the traceback says why
                bus.stats.rejected["internal-error"] += 1
                logger.exception("error while handling a message on %s", envelope.topic)

    async def _dispatch(self, envelope: Envelope) -> None:
        route = self.topics.route(envelope.topic)
        message = envelope.message
        if route is None:
            raise ProtocolError("unknown-topic", f"topic {envelope.topic} is outside the scheme")
        if route.node is not None and message.sender != route.node:
            raise ProtocolError("wrong-sender", f"sender {message.sender!r} on the topic of {route.node!r}")
        expected = {"node-status": Kind.NODE_STATUS, "acks": Kind.ACK, "updates": Kind.UPDATE}.get(route.channel)
        if expected is None:
            return  # our own topics echo nothing we subscribed to; ignore anything else
        if message.kind != expected:
            raise ProtocolError("unexpected-kind", f"{message.kind} on a {route.channel} topic")
        if route.channel == "node-status":
            await self._on_status(message)
        elif route.channel == "acks":
            self._on_ack(message)
        else:
            self._on_update(envelope)

    async def _on_status(self, message: Message) -> None:
        changed = await self.registry.apply_status(message.sender, message.meta)
        if changed is False and self.current is not None and not self.current.closed:
            self.current.on_offline(message.sender)

    def _on_ack(self, message: Message) -> None:
        state = self._state_for(message)
        if state is None or state.closed:
            return  # an ack for a closed round needs nothing
        state.on_ack(message.sender)
        if state.model_published and self._model_frame is not None:
            logger.info("node %s acknowledged after the broadcast; re-sending the model to it", message.sender)
            self._spawn(
                self._bus_or_fail().publish_frame(
                    self.topics.direct_model(message.sender),
                    self._model_frame,
                    round=state.round,
                    expiry_s=self.config.policy.deadline_s,
                )
            )

    def _on_update(self, envelope: Envelope) -> None:
        message = envelope.message
        state = self._state_for(message)
        node = message.sender
        if state is None:
            raise ProtocolError("wrong-round", f"update for round {message.round} matches no task sent to {node}")
        if state.answered(node) or node in state.carried:
            raise ProtocolError("duplicate-update", f"{node} already answered round {state.round}")
        if state.closed:
            self.late_arrivals += 1
            logger.warning(
                "late update from %s for round %d (now round %d): not aggregated", node, state.round, self.round
            )
            self._receipt_soon(message, "late", "the round closed before it arrived")
            return
        failure = message.meta.get("failed")
        if failure is not None:
            detail = str(failure)[:500]
            logger.warning("node %s reports its training for round %d failed: %s", node, state.round, detail)
            state.on_failed(node, detail)
            return
        try:
            update = parse_update(message, state, envelope.received_at)
        except ProtocolError:
            state.on_rejected(node, "invalid")
            raise
        state.on_accepted(update)
        logger.debug("update from %s accepted for round %d", node, state.round)
        self._receipt_soon(message, "received", "")

    def _state_for(self, message: Message) -> RoundState | None:
        """The round attempt a message answers: its round and task id must match one sent to its sender."""
        task = message.meta.get("task")
        for state in ([self.current] if self.current else []) + list(reversed(self._past)):
            if state.round == message.round and state.task_id == task:
                if message.sender not in state.selected:
                    raise ProtocolError("not-selected", f"{message.sender} was not selected for round {state.round}")
                return state
        return None

    # -- driving rounds --------------------------------------------------------------------

    async def _drive(self) -> None:
        policy = self.config.policy
        self._state = "waiting"
        await self._publish_status("waiting")
        try:
            await asyncio.wait_for(self.registry.wait_for_live(policy.min_nodes), policy.wait_for_nodes_s)
        except TimeoutError:
            raise CoordinatorError(
                f"only {len(self.registry.live_ids())} of the {policy.min_nodes} nodes needed came online within"
                f" {policy.wait_for_nodes_s:g} s; start the nodes, or lower min_nodes"
            ) from None
        self._state = "running"
        self._startup_s = time.monotonic() - self._started
        logger.info(
            "%d nodes live; starting at round %d of %d", len(self.registry.live_ids()), self.round, self.config.rounds
        )
        while self.round < self.config.rounds:
            await self._run_round(self.round)
            self.round += 1

    async def _run_round(self, rnd: int) -> None:
        policy = self.config.policy
        carried: dict[str, Any] = {}
        for attempt in range(policy.max_retries + 1):
            started = time.monotonic()
            state, outcome = await self._attempt(rnd, attempt, carried)
            updates = state.updates
            enough = len(updates) >= policy.min_updates
            last_try = policy.on_insufficient == "skip" or attempt == policy.max_retries
            record: dict[str, Any] = {
                "round": rnd,
                "attempt": attempt,
                "selected": list(state.selected),
                "accepted": list(outcome.accepted),
                "carried": list(outcome.carried),
                "late": list(outcome.late),
                "lost": list(outcome.lost),
                "rejected": list(outcome.rejected),
                "failed": list(outcome.failed),
                "live": len(self.registry.live_ids()),
            }
            if enough:
                self._record_participation(state, outcome)
                ctx = self._context(rnd, state.selected, "aggregate")
                failures = self._failures(rnd, outcome)
                ordered = [updates[k] for k in sorted(updates)]
                metrics = await asyncio.to_thread(self.half.aggregate, ctx, ordered, failures)
                metrics = {**self.half.averaging_metrics(), **metrics}
                await asyncio.to_thread(self._write_round_records)
                self.model_version += 1
                self.rounds_completed += 1
                record |= {"aggregated": True, **{k: float(v) for k, v in metrics.items()}}
                record |= await self._maybe_evaluate(rnd)
            else:
                self._record_participation(state, outcome, aggregated=False)
                record["aggregated"] = False
                if last_try and updates:
                    logger.warning(
                        "round %d: %d update(s) below min_updates=%d discarded: %s",
                        rnd,
                        len(updates),
                        policy.min_updates,
                        ", ".join(sorted(updates)),
                    )
                    record["discarded"] = sorted(updates)
                elif updates:
                    carried = dict(updates)  # the global model is unchanged, so these stay valid
            now = time.monotonic()
            record |= {
                "round_seconds": round(now - started, 4),
                "ended_s": round(now - self._started, 4),  # since the coordinator started: rounds per second
                "model_version": self.model_version,
            }
            self.run_dir.append_metrics(record)
            logger.info(
                "round %d attempt %d: %d accepted, %d late, %d lost%s%s",
                rnd,
                attempt,
                len(updates),
                len(outcome.late),
                len(outcome.lost),
                "" if enough else " (insufficient)",
                f", accuracy {record['accuracy']:.4f}" if "accuracy" in record else "",
            )
            if enough or last_try:
                break
        await self._checkpoint(rnd)
        await self._publish_status("running", round_done=rnd)

    async def _attempt(self, rnd: int, attempt: int, carried: dict[str, Any]) -> tuple[RoundState, RoundOutcome]:
        policy = self.config.policy
        live = self.registry.live_ids()
        if not live:
            logger.warning("round %d: no live node; waiting up to %g s for one", rnd, policy.wait_for_nodes_s)
            try:
                await asyncio.wait_for(self.registry.wait_for_live(1), policy.wait_for_nodes_s)
            except TimeoutError:
                raise CoordinatorError(f"no node came back online within {policy.wait_for_nodes_s:g} s") from None
            live = self.registry.live_ids()
        selection = sample(
            live,
            fraction=policy.fraction,
            over_selection=policy.over_selection,
            seed=self.config.seed,
            round=rnd,
            attempt=attempt,
            already=carried,
        )
        ctx = self._context(rnd, selection.selected, "configure")
        payload = await asyncio.to_thread(self.half.configure_round, ctx)
        task_id = os.urandom(16)
        model = Message(
            kind=Kind.MODEL,
            federation=self.config.federation,
            round=rnd,
            sender=SENDER,
            meta={"task": task_id, "payload": dict(payload.meta)},
            tensors=flatten_groups(payload.tensors),
        )
        state = RoundState(
            round=rnd,
            attempt=attempt,
            task_id=task_id,
            selected=selection.selected,
            target=selection.target,
            schema=self.half.update_schema(),
            carried=dict(carried),
        )
        if self.current is not None:
            self._past.append(self.current)
        self.current = state
        self.participation.selected(selection.selected, rnd)
        deadline = state.started + policy.deadline_s
        if self._fits_in_task(model):
            self._model_frame = None  # no broadcast, so nothing to re-send to a late acknowledgement
            state.model_published = True  # inside every task: no acknowledgement to wait for
            await self._send_tasks(state, ctx.settings.to_meta(), inline=model)
        else:
            self._model_frame = await asyncio.to_thread(encode, model)
            await self._send_tasks(state, ctx.settings.to_meta())
            await self._broadcast(state)
        try:
            await asyncio.wait_for(state.done.wait(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            logger.info("round %d: deadline of %g s reached", rnd, policy.deadline_s)
        return state, state.close(self.registry.is_live)

    def _fits_in_task(self, model: Message) -> bool:
        """Whether the round's model is small enough to ride in each task (sized without encoding it)."""
        limit = min(self.config.policy.inline_model_bytes, self._bus_or_fail().config.chunk_bytes // 2)
        return encoded_size(model) <= limit

    async def _broadcast(self, state: RoundState) -> None:
        """Wait for the selected nodes' acknowledgements (they subscribed), then publish the model once."""
        policy = self.config.policy
        try:
            await asyncio.wait_for(state.acks_complete.wait(), policy.ack_timeout_s)
        except TimeoutError:
            missing = sorted(set(state.selected) - state.acked - state.offline)
            logger.warning(
                "round %d: no acknowledgement from %s in %g s", state.round, ", ".join(missing), policy.ack_timeout_s
            )
        state.model_published = True
        assert self._model_frame is not None
        try:
            await self._bus_or_fail().publish_frame(
                self.topics.model(state.round), self._model_frame, round=state.round, expiry_s=policy.deadline_s
            )
        except BusError as exc:
            logger.error("round %d: model broadcast failed: %s", state.round, exc)

    async def _send_tasks(self, state: RoundState, settings: dict[str, Any], inline: Message | None = None) -> None:
        """One task per selected node; with `inline`, each task also carries the model's tensors and payload."""
        bus = self._bus_or_fail()
        policy = self.config.policy
        meta: dict[str, Any] = {
            "task": state.task_id,
            "attempt": state.attempt,
            "model_topic": self.topics.model(state.round),
            "deadline_s": policy.deadline_s,
            "settings": settings,
        }
        if inline is not None:
            meta |= {"inline": True, "payload": inline.meta["payload"]}
        tensors = inline.tensors if inline is not None else {}

        async def send(node: str) -> None:
            task = Message(
                kind=Kind.TASK, federation=self.config.federation, round=state.round, sender=SENDER,
                meta=meta, tensors=tensors,
            )  # fmt: skip
            state.task_sent_at[node] = time.monotonic()
            try:
                await bus.publish(self.topics.task(node), task, expiry_s=policy.deadline_s)
            except BusError as exc:
                logger.warning("round %d: task to %s failed: %s", state.round, node, exc)
                state.on_offline(node)

        await asyncio.gather(*(send(node) for node in state.selected))

    def _context(self, rnd: int, selected: tuple[str, ...], step: str) -> RoundContext:
        """What the algorithm half sees; `step` names its random stream (configure or aggregate)."""
        return RoundContext(
            round=rnd,
            selected=selected,
            participation=self.participation,
            settings=self.config.train.for_round(rnd),
            generator=torch_generator(self.config.seed, "coordinator", step, rnd),
        )

    def _record_participation(self, state: RoundState, outcome: RoundOutcome, *, aggregated: bool = True) -> None:
        """Only updates that are aggregated count as participation (KDIA's t_k and n_k)."""
        if aggregated:
            for update in state.updates.values():
                self.participation.accepted(
                    update.node_id,
                    state.round,
                    num_samples=update.num_samples,
                    rtt_s=round(update.rtt_seconds, 6),
                    train_s=round(update.train_seconds, 6),
                )
        for node in outcome.late:
            self.participation.late(node)
        for node in outcome.lost:
            self.participation.lost(node)
        for node in outcome.rejected:
            self.participation.rejected(node)
        for node in outcome.failed:
            self.participation.failed(node)

    def _write_round_records(self) -> None:
        for name, records in self.half.round_records().items():
            self.run_dir.append_records(name, records)

    @staticmethod
    def _failures(rnd: int, outcome: RoundOutcome) -> list[Failure]:
        return (
            [Failure(n, rnd, "late") for n in outcome.late]
            + [Failure(n, rnd, "lost") for n in outcome.lost]
            + [Failure(n, rnd, "rejected") for n in outcome.rejected]
            + [Failure(n, rnd, "failed") for n in outcome.failed]
        )

    async def _maybe_evaluate(self, rnd: int) -> dict[str, float]:
        last = rnd == self.config.rounds - 1
        if self.test_data is None or not (last or (rnd + 1) % self.config.eval_every == 0):
            return {}
        results = await asyncio.to_thread(self._evaluate)
        self.accuracies.append((rnd, results["accuracy"]))
        return results

    def _evaluate(self) -> dict[str, float]:
        """Test accuracy and loss of every model the half offers (the first unsuffixed), and their
        validation accuracy when a validation split exists; the final model is chosen on the latter."""
        assert self.test_data is not None
        device = torch.device(self.config.eval_device)
        out: dict[str, float] = {}
        models: dict[str, dict[str, float]] = {}
        for i, (name, model) in enumerate(self.half.evaluation_models().items()):
            accuracy, loss = evaluate(model, self.test_data, device=device)
            suffix = "" if i == 0 else f"_{name}"
            out[f"accuracy{suffix}"] = accuracy
            out[f"loss{suffix}"] = loss
            models[name] = {"test_accuracy": accuracy}
            if self.val_data is not None:
                models[name]["val_accuracy"] = out[f"val_accuracy{suffix}"] = evaluate(
                    model, self.val_data, device=device
                )[0]
        self.last_models = models
        return out

    def _final_model(self) -> dict[str, Any]:
        """The model a user should deploy: the best on the validation split at the last evaluation
        (never chosen on the test set); the first model when there is no validation split."""
        if not self.last_models:
            return {}
        names = list(self.last_models)
        chosen = names[0]
        if self.val_data is not None:
            chosen = max(names, key=lambda n: (self.last_models[n]["val_accuracy"], -names.index(n)))
        return {
            "final_model": chosen,
            "final_model_accuracy": self.last_models[chosen]["test_accuracy"],
            "models": self.last_models,
        }

    # -- persistence -----------------------------------------------------------------------

    async def _checkpoint(self, rnd: int) -> None:
        """Snapshot the state of round `rnd` (copies: the next round changes the originals) and let the
        writer put it on disk while the next round runs (coordinator/checkpoints.py)."""
        tensors = await asyncio.to_thread(self._snapshot_tensors)
        meta = {
            "round": rnd,
            "model_version": self.model_version,
            "rounds_completed": self.rounds_completed,
            "accuracies": self.accuracies,
            "participation": self.participation.to_json(),
            "federation": self.config.federation,
            "seed": self.config.seed,
        }
        self._checkpoints.submit(rnd, lambda: self._persist(tensors, meta))

    def _snapshot_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {f"model/{k}": v for k, v in self.half.model.state_dict().items()}
        tensors |= {f"extra/{k}": v for k, v in self.half.state_dict().items()}
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}

    def _persist(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        self.run_dir.save_checkpoint(tensors, meta)
        self.run_dir.write_json("participation.json", meta["participation"])

    def _resume(self) -> None:
        loaded = self.run_dir.load_checkpoint()
        if loaded is None:
            logger.info("no checkpoint in %s; starting from round 0", self.run_dir.root)
            return
        tensors, meta = loaded
        if meta.get("federation") != self.config.federation or meta.get("seed") != self.config.seed:
            raise CoordinatorError("the checkpoint belongs to another federation or seed; use another --out")
        model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        extra = {k.removeprefix("extra/"): v for k, v in tensors.items() if k.startswith("extra/")}
        try:
            self.half.model.load_state_dict(model)
            self.half.load_state_dict(extra)
            self.participation = ParticipationRecord.from_json(meta["participation"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CoordinatorError(f"checkpoint does not match this experiment: {exc}") from exc
        self.round = int(meta["round"]) + 1
        self.model_version = int(meta["model_version"])
        self.rounds_completed = int(meta["rounds_completed"])
        self.accuracies = [(int(r), float(a)) for r, a in meta["accuracies"]]
        self.run_dir.truncate_metrics_after(int(meta["round"]))
        logger.info("resumed from the checkpoint of round %d", meta["round"])

    def _write_summary(self) -> Summary:
        best = max((a for _, a in self.accuracies), default=None)
        final = self.accuracies[-1][1] if self.accuracies else None
        wall = time.monotonic() - self._started
        bus = self._bus.stats.as_dict() if self._bus else {}
        summary = {
            **self._extra_summary,
            "method": self.config.method,
            "federation": self.config.federation,
            "state": self._state,
            "nodes": len(self.registry),
            "rounds": self.config.rounds,
            "rounds_completed": self.rounds_completed,
            "final_accuracy": final,
            "best_accuracy": best,
            **self._final_model(),
            "wall_seconds": round(wall, 3),
            "startup_seconds": None if self._startup_s is None else round(self._startup_s, 3),
            "checkpoints": {
                "written_round": self._checkpoints.written_round,
                "replaced": self._checkpoints.replaced,
                "failures": self._checkpoints.failures,
            },
            "model_version": self.model_version,
            "late_arrivals": self.late_arrivals,
            "bus": bus,
            "participation_totals": {
                "accepted": sum(n.count for n in self.participation),
                "late": sum(n.late for n in self.participation),
                "lost": sum(n.lost for n in self.participation),
                "rejected": sum(n.rejected for n in self.participation),
                "failed": sum(n.failed for n in self.participation),
            },
        }
        self.run_dir.write_json("summary.json", summary)
        self.run_dir.write_json("participation.json", self.participation.to_json())
        self.run_dir.write_json(
            "nodes.json",
            [
                {
                    "node_id": n.node_id,
                    "online": n.online,
                    "device": n.device,
                    "num_samples": n.num_samples,
                    "label_histogram": n.label_histogram,
                }
                for n in self.registry.all()
            ],
        )
        return Summary(self.rounds_completed, final, best, wall, self._state)

    # -- publishing ------------------------------------------------------------------------

    def _status_message(self, state: str, *, round_done: int | None = None) -> Message:
        meta: dict[str, Any] = {
            "state": state,
            "run_id": self.run_id,
            "round": self.round,
            "rounds": self.config.rounds,
            "model_version": self.model_version,
            "live_nodes": len(self.registry.live_ids()),
        }
        if round_done is not None:
            meta["round_done"] = round_done
        if self.accuracies:
            meta["accuracy"] = self.accuracies[-1][1]
            meta["best_accuracy"] = max(a for _, a in self.accuracies)
        return Message(
            kind=Kind.COORDINATOR_STATUS, federation=self.config.federation, round=self.round, sender=SENDER, meta=meta
        )

    async def _publish_status(self, state: str, *, round_done: int | None = None) -> None:
        """Every round on the status topic (watchers); on the state topic (nodes) only when it changed."""
        message = self._status_message(state, round_done=round_done)
        bus = self._bus_or_fail()
        await bus.publish(self.topics.coordinator_status, message, retain=True)
        if state != self._published_state:
            await bus.publish(self.topics.coordinator_state, message, retain=True)
            self._published_state = state

    async def _publish_status_quietly(self, state: str) -> None:
        try:
            await asyncio.wait_for(self._publish_status(state), 5)
        except (BusError, TimeoutError) as exc:
            logger.warning("could not publish the final status: %s", exc)

    def _receipt_soon(self, message: Message, status: str, reason: str) -> None:
        receipt = Message(
            kind=Kind.RECEIPT,
            federation=self.config.federation,
            round=message.round,
            sender=SENDER,
            meta={
                "status": status,
                "reason": reason,
                "task": message.meta.get("task"),
                "update_id": message.message_id,
            },
        )
        if isinstance(receipt.meta["task"], bytes | None):
            self._spawn(self._bus_or_fail().publish(self.topics.receipt(message.sender), receipt, qos=0))

    def _spawn(self, coro: Any) -> None:
        """Background publishes are kept and harvested, never fire-and-forget."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._harvest)

    def _harvest(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("background publish failed: %s", task.exception())

    def _bus_or_fail(self) -> BusClient:
        if self._bus is None:
            raise RuntimeError("the coordinator is not connected")
        return self._bus
