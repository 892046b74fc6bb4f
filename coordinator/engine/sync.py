"""Synchronous rounds as a state machine: sample, configure, send, collect until K updates, everyone
answered or the deadline, aggregate (or retry, or skip), evaluate, checkpoint, next round.

Each round attempt goes through four phases, each ended by an event:

    configuring  --Configured-->  collecting  --(done | deadline)-->  aggregating  --Aggregated-->
    evaluating   --Evaluated-->   the next attempt or round

While collecting, a broadcast round first waits for the selected nodes' acknowledgements (or
ack_timeout_s) and publishes the model once; an inline round (small models) has nothing to wait for.
With ``policy.late_updates: carry`` an update that comes after its round closed is validated and
folded into the next aggregation with its staleness weight instead of being refused.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Any

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import Engine, node_task_id, public_model_id
from fedmq.coordinator.engine.commands import SecureSum
from fedmq.coordinator.engine.secure import SecurePhase, SecureRound, graph_seed
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.rounds import RoundOutcome, RoundState
from fedmq.coordinator.sampler import Selection, sample
from fedmq.coordinator.updates import check_base_version, parse_update
from fedmq.fedcore.algorithms.base import Failure, Folding, NodeUpdate
from fedmq.fedcore.masked import round_key
from fedmq.fedcore.protocol import RunState, SecAggKeys, SecAggReveal, SecAggShares, UpdateFailed, parse

logger = logging.getLogger(__name__)

PAST_ROUNDS_KEPT = 64
"""Closed attempts whose late updates and acknowledgements are still recognised."""


class SyncRounds(Engine):
    """The synchronous round policy (`RoundPolicy`), driven by events."""

    def __init__(self, *args: Any, evaluates: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.evaluates = evaluates
        self.round = 0
        self.attempt = 0
        self.rounds_completed = 0
        self.current: RoundState | None = None
        self.phase = "idle"
        self._past: deque[RoundState] = deque(maxlen=PAST_ROUNDS_KEPT)
        self._carried: dict[str, NodeUpdate] = {}
        self._late: dict[str, NodeUpdate] = {}
        """Late updates accepted for the next aggregation (``late_updates: carry``)."""
        self._late_from: dict[str, tuple[int, int]] = {}
        """The (round, attempt) each of them answered: a second one is a duplicate."""
        self._selection: tuple[tuple[str, ...], int, bytes] | None = None
        self._configure_step = 0
        self._broadcast_step = 0
        self._inline = False
        self._ack_deadline: float | None = None
        self._attempt_started = 0.0
        self._record: dict[str, Any] = {}
        self._outcome_step = 0
        self.rejected_models: Counter[str] = Counter()
        """Per node, the rejected models its updates went into (``policy.exclude_after``)."""
        self.excluded: set[str] = set()
        """Nodes given no more tasks after too many rejected models."""
        self.rounds_without_model = 0
        """Rounds in a row that ended without aggregating (``policy.max_rounds_without_model``)."""
        self._secure: SecureRound | None = None
        """The attempt's secure aggregation (`engine.secure`), with ``secure_aggregation`` configured."""
        self._secure_outcome: RoundOutcome | None = None
        """The round's outcome, fixed when its unmask step began."""

    # -- starting an attempt -----------------------------------------------------------------------

    def _begin(self, out: list[c.Command], now: float) -> None:
        if self.round >= self.config.rounds:
            self._finish(out)
            return
        self._start_attempt(out, now)

    def _resume_waiting(self, out: list[c.Command], now: float) -> None:
        self._start_attempt(out, now)

    def _start_attempt(self, out: list[c.Command], now: float) -> None:
        live = sorted(self.live - self.excluded)
        if not live and self.live:
            self._fail(out, f"every live node is excluded after rejected models: {', '.join(sorted(self.live))}")
            return
        if not live:
            logger.warning(
                "round %d: no live node; waiting up to %g s for one", self.round, self.policy.wait_for_nodes_s
            )
            self.phase = "waiting"
            self._wait(out, 1, now)
            return
        self._attempt_started = now
        selection = self._select(live)
        ctx = self._context(self.round, selection.selected, "configure")
        secret = self.new_id()  # the attempt's: never sent; each node's task id is derived from it
        self._selection = (selection.selected, selection.target, secret)
        self._configure_step = self._next_step()
        model = public_model_id(secret)
        tasks = tuple(
            c.TaskSpec(n, node_task_id(secret, n), self.round, self.attempt, self.version, model)
            for n in selection.selected
        )
        self.phase = "configuring"
        out.append(
            c.Configure(
                self._configure_step,
                ctx,
                tasks,
                ctx.settings.to_meta(),
                self.policy.deadline_s,
                keep_model=self.keeps_models(),
            )
        )

    def _select(self, live: list[str], stratum: str | None = None) -> Selection:
        return sample(
            live,
            fraction=self.policy.fraction,
            over_selection=self.policy.over_selection,
            seed=self.config.seed,
            round=self.round,
            attempt=self.attempt,
            already=self._carried,
            stratum=stratum,
        )

    def _configured(self, out: list[c.Command], event: e.Configured, now: float) -> None:
        if self.phase != "configuring" or event.step != self._configure_step or self._selection is None:
            return
        selected, target, task_id = self._selection
        state = RoundState(
            round=self.round,
            attempt=self.attempt,
            task_id=task_id,
            selected=selected,
            target=target,
            schema=self.schema,
            carried=dict(self._carried),
            started=now,
            version=self.version,
            issued=frozenset(node_task_id(task_id, n) for n in selected),
        )
        if self.current is not None:
            self.current.forget_tensors()
            self._past.append(self.current)
        self.current = state
        self.participation.selected(selected, self.round)
        self._secure = self._secure_round(state, now)
        self.phase = "collecting"
        self._inline = event.inline
        for node in selected:
            state.task_sent_at[node] = now
            out.append(c.SendTask(event.step, node))
        if event.inline:
            state.model_published = True  # inside every task: no acknowledgement to wait for
        else:
            self._broadcast_step = event.step
            self._ack_deadline = now + self.policy.ack_timeout_s
            self._maybe_broadcast(out)
        self._maybe_close(out, now)

    def _maybe_broadcast(self, out: list[c.Command], *, timed_out: bool = False) -> None:
        state = self.current
        if state is None or state.model_published or not (state.acks_complete or timed_out):
            return
        if timed_out:
            missing = sorted(set(state.selected) - state.acked - state.offline)
            logger.warning(
                "round %d: no acknowledgement from %s in %g s",
                state.round,
                ", ".join(missing),
                self.policy.ack_timeout_s,
            )
        state.model_published = True
        self._ack_deadline = None
        out.append(c.Broadcast(self._broadcast_step, state.round))

    # -- collecting ----------------------------------------------------------------------------------

    def _on(self, out: list[c.Command], event: e.Event, now: float) -> None:
        if isinstance(event, e.Configured):
            self._configured(out, event, now)
        elif isinstance(event, e.Acked):
            self._acked(out, event, now)
        elif isinstance(event, e.SecAggArrived):
            self._on_secagg(out, event, now)
        elif isinstance(event, e.TaskUnsent):
            self._offline(out, event.node, now)
        elif isinstance(event, e.Aggregated):
            self._aggregated(out, event, now)
        elif isinstance(event, e.Evaluated):
            self._evaluated(out, event, now)

    def _state_for(self, node: str, round: int, task: object) -> RoundState | None:
        """The attempt a message answers: its round and task id must be those sent to its sender, the
        id being the node's own (`node_task_id`). An id sent to another node of the round, or the
        broadcast's model id, is refused as ``foreign-task``: its sender is not who the id was for."""
        if not isinstance(task, bytes):
            return None
        states = ([self.current] if self.current else []) + list(reversed(self._past))
        for state in states:
            if state.round == round and node_task_id(state.task_id, node) == task:
                if node not in state.selected:
                    raise ProtocolError("not-selected", f"{node} was not selected for round {state.round}")
                return state
        for state in states:  # only for a message that matched nothing: the cost of a refusal
            if state.round != round:
                continue
            if task == public_model_id(state.task_id):
                raise ProtocolError(
                    "foreign-task", f"{node} quotes the model broadcast's id of round {round}, not a task id"
                )
            if task in state.issued:
                raise ProtocolError("foreign-task", f"{node} quotes the task id sent to another node in round {round}")
        return None

    def _acked(self, out: list[c.Command], event: e.Acked, now: float) -> None:
        try:
            state = self._state_for(event.node, event.round, event.task)
        except ProtocolError as exc:
            self.refused[exc.reason] += 1
            out.append(c.Refused(event.node, exc.reason, exc.detail))
            return
        if state is None or state.closed:
            return  # an ack for a closed round needs nothing
        state.on_ack(event.node)
        if state.model_published and state is self.current and not self._inline:
            logger.info("node %s acknowledged after the broadcast; re-sending the model to it", event.node)
            out.append(c.Resend(self._broadcast_step, event.node))
        self._maybe_broadcast(out)
        self._maybe_close(out, now)

    def _on_liveness(self, out: list[c.Command], node: str, online: bool, now: float) -> None:
        if not online:
            self._offline(out, node, now)

    def _offline(self, out: list[c.Command], node: str, now: float) -> None:
        state = self.current
        if state is not None and not state.closed:
            state.on_offline(node)
            self._maybe_broadcast(out)
            self._maybe_close(out, now)

    def _on_update(self, out: list[c.Command], event: e.UpdateArrived, now: float) -> None:
        message = event.message
        node = message.sender
        state = self._state_for(node, message.round, message.meta.get("task"))
        if state is None:
            raise ProtocolError("wrong-round", f"update for round {message.round} matches no task sent to {node}")
        late_from = {self._late_from.get(node), self._late_from.get(_partial_key(node, state.round))}
        if state.answered(node) or node in state.carried or (state.round, state.attempt) in late_from:
            raise ProtocolError("duplicate-update", f"{node} already answered round {state.round}")
        if state.closed:
            self._late_update(out, state, event)
            return
        if self._secure is not None and not UpdateFailed.is_failure(message.meta):
            self._check_masking(state, node)
        if UpdateFailed.is_failure(message.meta):
            detail = UpdateFailed.from_meta(message.meta).reason
            logger.warning("node %s reports its training for round %d failed: %s", node, state.round, detail)
            state.on_failed(node, detail)
        else:
            try:
                update = self._parse(state, event)
            except ProtocolError as exc:
                # not an answer: anyone can publish on a node's topic until the broker authenticates
                # senders, so the node's own valid update is still taken until the round closes
                state.on_rejected(node, exc.reason)
                self._refuse(out, message, exc.reason, exc.detail)
            else:
                state.on_accepted(update)
                logger.debug("update from %s accepted for round %d", node, state.round)
                self._receipt(out, message, "received")
        self._maybe_close(out, now)

    def _late_update(self, out: list[c.Command], state: RoundState, event: e.UpdateArrived) -> None:
        """After its round closed: refused as late, or (late_updates: carry) kept for the next aggregation."""
        message = event.message
        node = message.sender
        carry = self.policy.late_updates == "carry" and self._aggregation_ahead()
        if not carry or UpdateFailed.is_failure(message.meta):
            self.late_arrivals += 1
            logger.warning(
                "late update from %s for round %d (now round %d): not aggregated", node, state.round, self.round
            )
            self._receipt(out, message, "late", "the round closed before it arrived")
            return
        staleness = self._fold_version() - state.version
        limit = self.config.asynchronous.max_staleness
        if staleness > limit:
            self.late_arrivals += 1
            self._decline(
                out,
                message,
                "stale",
                f"trained from version {state.version}, {staleness} behind (max {limit})",
                "stale",
            )
            return
        update = self._parse(state, event)
        # a site's partial is kept by round: its nodes' work is not the work of its later partials
        key = node if update.site_nodes == 0 else _partial_key(node, state.round)
        if key in self._late:
            logger.info("%s's late update of round %d replaces its older late one", node, state.round)
        self._late[key] = update
        self._late_from[key] = (state.round, state.attempt)
        logger.info("late update from %s for round %d carried into the next aggregation", node, state.round)
        self._receipt(out, message, "received", "late: carried into the next aggregation")

    def _parse(self, state: RoundState, event: e.UpdateArrived) -> NodeUpdate:
        """The update, checked against the attempt it answers; ProtocolError says why not."""
        message = event.message
        check_base_version(message, state.version)
        update = parse_update(
            message,
            self.schema,
            version=state.version,
            sent_at=state.task_sent_at.get(message.sender, state.started),
            received_at=event.received_at,
            compression=self.config.compression,
            ingested=event.ingested,
        )
        self._check_samples(update)
        return update

    def _aggregation_ahead(self) -> bool:
        """Whether an aggregation is still to come that a carried update could join."""
        if self.phase in ("configuring", "collecting", "waiting"):
            return True
        return self.round + 1 < self.config.rounds

    def _keep_from(self) -> int:
        """The oldest version an update may come from once this aggregation is done: the next round's
        (kept when it is configured), or with late updates carried, max_staleness versions before it
        (`_late_update` refuses those staler still)."""
        lag = self.config.asynchronous.max_staleness if self.policy.late_updates == "carry" else 0
        return self.version + 1 - lag

    def _fold_version(self) -> int:
        """The version the next aggregation folds from (one more while an aggregation is running)."""
        return self.version + (1 if self.phase == "aggregating" else 0)

    # -- secure aggregation (engine.secure) -----------------------------------------------------------

    def _secure_round(self, state: RoundState, now: float) -> SecureRound | None:
        settings = self.config.secure_aggregation
        if settings is None:
            return None
        secure = SecureRound(
            settings=settings,
            key=round_key(self.config.federation, state.round, state.attempt, public_model_id(state.task_id)),
            tasks={n: node_task_id(state.task_id, n) for n in state.selected},
            announced={n: self.announced.get(n) for n in state.selected},
            timeout_s=self.config.secure_timeout_s,
            seed=graph_seed(state.task_id),
        )
        secure.start(now)
        return secure

    def _check_masking(self, state: RoundState, node: str) -> None:
        """A masked update is taken only in its attempt's masking step, from a node whose shares are out."""
        secure = self._secure
        if secure is None or state is not self.current or secure.phase != SecurePhase.MASKED:
            raise ProtocolError("secagg-out-of-step", f"{node}'s update came outside its attempt's masking step")
        if node not in secure.shared:
            raise ProtocolError("secagg-out-of-step", f"{node}'s update came, but its shares did not in time")

    def _on_secagg(self, out: list[c.Command], event: e.SecAggArrived, now: float) -> None:
        message = event.message
        try:
            parsed = parse(str(message.kind), message.meta)
            if not isinstance(parsed, SecAggKeys | SecAggShares | SecAggReveal):
                raise ProtocolError("unexpected-kind", f"{message.kind} is not sent by nodes")
            state = self._state_for(message.sender, message.round, parsed.task_id)
            secure = self._secure
            if state is None or state is not self.current or secure is None:
                raise ProtocolError("secagg-out-of-step", f"{message.kind} from {message.sender} answers no open step")
            secure.receive(message.sender, parsed)
        except ProtocolError as exc:
            self.refused[exc.reason] += 1
            out.append(c.Refused(message.sender, exc.reason, exc.detail))
            return
        self._maybe_close(out, now)

    def _advance_secure(self, out: list[c.Command], state: RoundState, secure: SecureRound, now: float) -> bool:
        """Move the keys and shares steps on; True once the masked updates are what the round waits
        for (the usual closing then applies), False while a step runs or when the attempt ended."""
        still_in = state.waiting_for
        steps = (SecurePhase.KEYS, secure.send_directory), (SecurePhase.SHARES, lambda o, _: secure.send_shared(o))
        for phase, send in steps:
            if secure.phase == phase and secure.due(now, still_in):
                left, why = send(out, now)
                for node in left:
                    if not state.answered(node) and node not in state.offline:
                        state.on_failed(node, f"secure aggregation: no {phase} from it in time")
                if why is not None:
                    self._close(out, state, state.close(self.live.__contains__), now, secure_failure=why)
                    return False
        if secure.phase == SecurePhase.MASKED:
            return True
        if now >= state.started + self.policy.deadline_s:
            why = f"the round's deadline passed in its {secure.phase} step"
            self._close(out, state, state.close(self.live.__contains__), now, secure_failure=why)
        return False

    def _unmask(self, out: list[c.Command], state: RoundState, secure: SecureRound, now: float) -> None:
        """The round closed: ask the survivors for the shares that unmask their sum."""
        outcome = state.close(self.live.__contains__)
        why = secure.send_unmask(out, frozenset(state.accepted), now)
        if why is not None:
            self._close(out, state, outcome, now, secure_failure=why)
            return
        self.phase = "unmasking"
        self._secure_outcome = outcome

    def _unmasked(self, out: list[c.Command], now: float) -> None:
        state, secure, outcome = self.current, self._secure, self._secure_outcome
        if state is None or secure is None or outcome is None or not secure.unmask_due(now):
            return
        self._secure_outcome = None
        material, why = secure.finish(frozenset(state.accepted))
        self.phase = "collecting"  # what _close expects of an attempt it ends
        self._close(out, state, outcome, now, secure=material, secure_failure=why)

    # -- closing ---------------------------------------------------------------------------------------

    def _deadlines(self) -> Sequence[float | None]:
        state = self.current
        secure = self._secure
        if self.phase == "unmasking" and secure is not None:
            return (secure.deadline,)
        if self.phase != "collecting" or state is None:
            return ()
        steps = (secure.deadline,) if secure is not None and secure.phase != SecurePhase.MASKED else ()
        if not state.model_published:
            return (self._ack_deadline, *steps)
        return (state.started + self.policy.deadline_s, *steps)

    def _on_tick(self, out: list[c.Command], now: float) -> None:
        if self.phase == "unmasking":
            self._maybe_close(out, now)
        if self.phase != "collecting":
            return
        if self._ack_deadline is not None and now >= self._ack_deadline:
            self._maybe_broadcast(out, timed_out=True)
        self._maybe_close(out, now)

    def _maybe_close(self, out: list[c.Command], now: float) -> None:
        if self.phase == "unmasking":
            self._unmasked(out, now)
            return
        state = self.current
        if self.phase != "collecting" or state is None:
            return
        secure = self._secure
        if secure is not None and not self._advance_secure(out, state, secure, now):
            return
        if not state.model_published:
            return
        past_deadline = now >= state.started + self.policy.deadline_s
        if not (state.done or past_deadline):
            return
        if past_deadline and not state.done:
            logger.info("round %d: deadline of %g s reached", state.round, self.policy.deadline_s)
        if secure is not None:
            self._unmask(out, state, secure, now)
            return
        self._close(out, state, state.close(self.live.__contains__), now)

    def _close(
        self,
        out: list[c.Command],
        state: RoundState,
        outcome: RoundOutcome,
        now: float,
        *,
        secure: SecureSum | None = None,
        secure_failure: str | None = None,
    ) -> None:
        """End the attempt's collecting: aggregate what it holds, or try again, or move on. With secure
        aggregation, `secure` unmasks the sum, or `secure_failure` says why it cannot be."""
        policy = self.policy
        updates = state.updates
        late, superseded = self._late_for(updates)
        enough = len(updates) + len(late) >= policy.min_updates and secure_failure is None
        last_try = policy.on_insufficient == "skip" or self.attempt == policy.max_retries
        record: dict[str, Any] = {
            "round": state.round,
            "attempt": state.attempt,
            "selected": list(state.selected),
            "accepted": list(outcome.accepted),
            "carried": list(outcome.carried),
            "late": list(outcome.late),
            "lost": list(outcome.lost),
            "rejected": list(outcome.rejected),
            "failed": list(outcome.failed),
            "live": len(self.live),
        }
        if late or superseded:
            record |= {"late_folded": sorted(late), "superseded": superseded}
        if secure_failure is not None:
            logger.warning(
                "round %d attempt %d: secure aggregation cannot unmask: %s", state.round, state.attempt, secure_failure
            )
            record["secure_aggregation_failed"] = secure_failure
        self._record = record
        if enough:
            self._record_participation(state, outcome, late)
            folded = {**updates, **late}
            folding = Folding(staleness=self.config.asynchronous.staleness) if late else None
            ctx = self._context(state.round, state.selected, "aggregate", folding=folding)
            ordered = [folded[k] for k in sorted(folded)]
            self._late, self._late_from = {}, {}
            self.phase = "aggregating"
            self._outcome_step = self._next_step()
            failures = self._failures(state.round, outcome)
            out.append(
                c.Aggregate(self._outcome_step, ctx, ordered, failures, keep_from=self._keep_from(), secure=secure)
            )
            return
        self._record_participation(state, outcome, {}, aggregated=False)
        record["aggregated"] = False
        if last_try and (updates or late):
            kept = sorted({*updates, *(f"{n} (late)" for n in late)})
            logger.warning(
                "round %d: %d update(s) below min_updates=%d discarded: %s",
                state.round,
                len(kept),
                policy.min_updates,
                ", ".join(kept),
            )
            record["discarded"] = kept
            self._late, self._late_from = {}, {}
        elif updates and self._secure is None:  # masked updates are the attempt's alone
            self._carried = dict(updates)  # the global model is unchanged, so these stay valid
        self._end_attempt(out, now, aggregated=False, last_try=last_try)

    def _late_for(self, updates: Mapping[str, NodeUpdate]) -> tuple[dict[str, NodeUpdate], list[str]]:
        """The carried late updates this aggregation folds, with their staleness; a node whose fresh
        update is in the round supersedes its late one (named, never dropped silently). A site's late
        partial is never superseded (it is kept as SITE@ROUND): it speaks for other work than its fresh one."""
        superseded = sorted(n for n in self._late if n in updates)
        for node in superseded:
            logger.info("round %d: %s's fresh update supersedes its late one", self.round, node)
        late = {
            n: dataclasses.replace(u, staleness=self.version - u.base_version)
            for n, u in self._late.items()
            if n not in updates
        }
        return late, superseded

    def _record_participation(
        self, state: RoundState, outcome: RoundOutcome, late: Mapping[str, NodeUpdate], *, aggregated: bool = True
    ) -> None:
        """Only updates that are aggregated count as participation (KDIA's t_k and n_k)."""
        if aggregated:
            for update in sorted([*state.updates.values(), *late.values()], key=lambda u: u.node_id):
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

    @staticmethod
    def _failures(rnd: int, outcome: RoundOutcome) -> list[Failure]:
        return (
            [Failure(n, rnd, "late") for n in outcome.late]
            + [Failure(n, rnd, "lost") for n in outcome.lost]
            + [Failure(n, rnd, "rejected") for n in outcome.rejected]
            + [Failure(n, rnd, "failed") for n in outcome.failed]
        )

    # -- after the aggregation -------------------------------------------------------------------------

    def _aggregated(self, out: list[c.Command], event: e.Aggregated, now: float) -> None:
        if self.phase != "aggregating" or event.step != self._outcome_step:
            return
        if event.rejected:  # the half fell back to the last good model already
            failed = event.rejected.startswith("secure aggregation")
            self._reject(out, now, event.rejected if failed else f"the aggregated model holds {event.rejected}")
            return
        self.version += 1
        self._record |= {"aggregated": True, **{k: float(v) for k, v in event.metrics.items()}}
        if self.evaluates and self._eval_due(self.round, self.config.rounds - 1):
            self.phase = "evaluating"
            out.append(c.Evaluate(self._outcome_step))
            return
        self._end_attempt(out, now, aggregated=True, last_try=True)

    def _evaluated(self, out: list[c.Command], event: e.Evaluated, now: float) -> None:
        if self.phase != "evaluating" or event.step != self._outcome_step:
            return
        self._record |= dict(event.metrics)
        collapse = self._collapse(event.metrics.get("accuracy"))
        if collapse is not None:  # never published: the next round starts from the last good model
            self.version -= 1
            out.append(c.Rollback(self._outcome_step, collapse))
            self._reject(out, now, collapse)
            return
        if "accuracy" in event.metrics:
            self.accuracies.append((self.round, float(event.metrics["accuracy"])))
        self._end_attempt(out, now, aggregated=True, last_try=True)

    def _collapse(self, accuracy: float | None) -> str | None:
        """Why the model's accuracy rejects it (``policy.reject_below`` of the best so far), or None."""
        share = self.policy.reject_below
        if share is None or accuracy is None or not self.accuracies:
            return None
        best = max(a for _, a in self.accuracies)
        if accuracy >= share * best:
            return None
        return f"its accuracy {accuracy:.4f} fell below {share:g} of the best so far, {best:.4f}"

    def _reject(self, out: list[c.Command], now: float, reason: str) -> None:
        """The round's model is not kept: its updates are named as suspects (a node in too many
        rejected models is excluded) and the round runs again on the last good model."""
        suspects = sorted({*self._record.get("accepted", []), *self._record.get("late_folded", [])})
        outliers = outlying_updates(self.current.updates if self.current is not None else {})
        logger.warning(
            "round %d attempt %d: model rejected, %s; the last good model stays (updates from %s%s)",
            self.round, self.attempt, reason, ", ".join(suspects) or "none",
            f"; far from the others: {', '.join(outliers)}" if outliers else "",
        )  # fmt: skip
        self._record |= {"aggregated": False, "model_rejected": reason, "suspects": suspects, "outliers": outliers}
        self.rejected_models.update(outliers)
        limit = self.policy.exclude_after
        newly = sorted(n for n in outliers if limit is not None and self.rejected_models[n] >= limit) if limit else []
        newly = [n for n in newly if n not in self.excluded]
        if newly:
            self.excluded.update(newly)
            self._record["excluded"] = newly
            logger.warning("excluded after %d rejected models: %s (no more tasks)", limit, ", ".join(newly))
        self._end_attempt(out, now, aggregated=False, last_try=self.attempt >= self.policy.max_retries)

    def _end_attempt(self, out: list[c.Command], now: float, *, aggregated: bool, last_try: bool) -> None:
        record = self._record
        record |= {
            "round_seconds": round(now - self._attempt_started, 4),
            "ended_s": round(self._since_start(now), 4),  # since the coordinator started: rounds per second
            "model_version": self.version,
        }
        out.append(c.Record(record))
        state = self.current
        outcome_late = record["late"]
        logger.info(
            "round %d attempt %d: %d accepted, %d late, %d lost%s%s",
            self.round,
            self.attempt,
            len(state.updates) if state is not None else 0,
            len(outcome_late),
            len(record["lost"]),
            "" if aggregated else " (model rejected)" if "model_rejected" in record else " (insufficient)",
            f", accuracy {record['accuracy']:.4f}" if "accuracy" in record else "",
        )
        self._record = {}
        if not (aggregated or last_try):
            self.attempt += 1
            self._start_attempt(out, now)
            return
        if aggregated:  # counted with its checkpoint, so a summary written mid-evaluation says what resumes
            self.rounds_completed += 1
        self.rounds_without_model = 0 if aggregated else self.rounds_without_model + 1
        bound = self.policy.max_rounds_without_model
        if bound is not None and self.rounds_without_model >= bound:
            why = record.get("model_rejected") or (
                f"{len(record['accepted'])} update(s) accepted, min_updates is {self.policy.min_updates}"
            )
            self._fail(
                out,
                f"{self.rounds_without_model} rounds in a row ended without a new model (the last, round"
                f" {self.round}: {why}); policy.max_rounds_without_model stops a federation that cannot progress",
            )
            return
        out.append(c.Checkpoint(self.round, self.checkpoint_meta()))
        out.append(self.status(round_done=self.round))
        self.round += 1
        self.attempt = 0
        self._carried = {}
        self.phase = "idle"
        if self.round >= self.config.rounds:
            self._finish(out)
        else:
            self._start_attempt(out, now)

    # -- the rest ---------------------------------------------------------------------------------------

    def _stop(self, out: list[c.Command], event: e.Stop, now: float) -> None:
        self.state = RunState.STOPPED
        out.append(c.Finish(RunState.STOPPED, event.reason))

    def status_fields(self) -> dict[str, Any]:
        return {"round": self.round, "rounds": self.config.rounds, "model_version": self.version}

    def checkpoint_meta(self) -> dict[str, Any]:
        guard = {"rejected_models": dict(self.rejected_models), "excluded": sorted(self.excluded)}
        state = {"engine": "sync", "round": self.round, "rounds_completed": self.rounds_completed}
        stalled = {"rounds_without_model": self.rounds_without_model} if self.rounds_without_model else {}
        return state | (guard if self.rejected_models else {}) | stalled | self._common_meta()

    def restore(self, meta: Mapping[str, Any]) -> None:
        self._restore_common(meta)
        self.round = int(meta["round"]) + 1
        self.rounds_completed = int(meta["rounds_completed"])
        self.rejected_models = Counter({str(k): int(v) for k, v in meta.get("rejected_models", {}).items()})
        self.excluded = {str(n) for n in meta.get("excluded", [])}
        self.rounds_without_model = int(meta.get("rounds_without_model", 0))

    def summary_fields(self) -> dict[str, Any]:
        return super().summary_fields() | {"rounds": self.config.rounds, "rounds_completed": self.rounds_completed}


OUTLIER_FACTOR = 3.0
"""An update whose norm is this many times the round's median, or as many times below it, stands out."""


def outlying_updates(updates: Mapping[str, NodeUpdate]) -> list[str]:
    """The nodes whose update stands out from the round's others by its norm (three or more updates):
    when the round's model is rejected, these are the ones counted against ``policy.exclude_after``,
    not every node that happened to share the round with them (a -1000x model has 1000x the norm)."""
    if len(updates) < 3:
        return []
    norms = {node: _norm(u) for node, u in updates.items()}
    middle = statistics.median(norms.values())
    if not middle > 0:
        return sorted(n for n, x in norms.items() if x > 0)
    return sorted(n for n, x in norms.items() if x > OUTLIER_FACTOR * middle or x * OUTLIER_FACTOR < middle)


def _norm(update: NodeUpdate) -> float:
    total = 0.0
    for group in update.payload.tensors.values():
        for tensor in group.values():
            if tensor.is_floating_point():
                total += float(tensor.double().pow(2).sum())
    return math.sqrt(total)


def _partial_key(node: str, round: int) -> str:
    """Where a site aggregator's late partial of `round` is kept (and named in the metrics: late_folded)."""
    return f"{node}@{round}"
