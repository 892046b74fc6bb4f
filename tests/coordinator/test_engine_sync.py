"""SyncRounds on a fake clock: every round policy decision without a broker, in milliseconds."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.sync import SyncRounds
from tests.coordinator.engine_helpers import SAMPLES, Driver, config, failure, of, one, seen, update

NODES = ("a", "b", "c")


def _round(d: Driver, *, inline: bool = True) -> c.Configure:
    """The pending Configure of the engine, configured (as the daemon would report)."""
    configure = of(c.Configure, d.log)[-1]
    d.feed(e.Configured(configure.step, inline=inline))
    return configure


def test_sync_round_closes_when_everyone_answered_then_aggregates_evaluates_and_moves_on() -> None:
    """All three updates in: one Aggregate (updates by node id), then Evaluate, Record, Checkpoint, status, round 1."""
    d = Driver(config(policy={"min_nodes": 3}))
    assert of(c.Configure, d.start(*NODES[:2])) == [], "round 0 began before min_nodes were live"
    configure = one(c.Configure, d.feed(seen("c")))
    assert [t.node for t in configure.tasks] == list(NODES) and {t.version for t in configure.tasks} == {0}
    out = d.feed(e.Configured(configure.step, inline=True))
    assert [s.node for s in of(c.SendTask, out)] == list(NODES) and not of(c.Broadcast, out)
    tasks = {t.node: t for t in configure.tasks}
    d.feed(update(tasks["c"]), at=1.0)
    d.feed(update(tasks["a"]), at=1.5)
    out = d.feed(update(tasks["b"]), at=2.0)
    aggregate = one(c.Aggregate, out)
    assert [u.node_id for u in aggregate.updates] == list(NODES) and aggregate.failures == []
    assert all(u.base_version == 0 and u.staleness == 0 for u in aggregate.updates)
    assert len(of(c.Receipt, d.log)) == 3 and {r.status for r in of(c.Receipt, d.log)} == {"received"}
    evaluate = one(c.Evaluate, d.feed(e.Aggregated(aggregate.step, {"train_loss": 0.5}), at=2.1))
    out = d.feed(e.Evaluated(evaluate.step, {"accuracy": 0.75, "loss": 1.0}), at=2.2)
    record = one(c.Record, out).record
    assert record["accepted"] == list(NODES) and record["accuracy"] == 0.75 and record["model_version"] == 1
    assert record["round_seconds"] == pytest.approx(2.2) and record["train_loss"] == 0.5
    assert one(c.Checkpoint, out).key == 0 and one(c.PublishStatus, out).fields["round_done"] == 0
    assert one(c.Configure, out).ctx.round == 1 and one(c.Configure, out).tasks[0].version == 1
    assert d.engine.participation.get("a").last_round == 0  # type: ignore[union-attr]


def test_sync_tasks_expire_at_the_rounds_deadline() -> None:
    """The engine decides when a task goes stale (issue 30, item 4): every attempt's Configure
    carries policy.deadline_s, which the daemon sets as its tasks' and model's MQTT expiry."""
    d = Driver(config(policy={"deadline_s": 7.0}))
    d.start(*NODES)
    assert _round(d).expiry_s == 7.0


def test_sync_round_closes_at_the_deadline_and_the_silent_node_is_late() -> None:
    """No update from c: the engine asks for a tick at started + deadline_s and closes then, c late."""
    d = Driver(config())
    d.start(*NODES)
    configure = _round(d)
    tasks = {t.node: t for t in configure.tasks}
    d.feed(update(tasks["a"]), at=1)
    d.feed(update(tasks["b"]), at=2)
    assert d.engine.next_deadline() == pytest.approx(10.0)
    assert not of(c.Aggregate, d.tick(9.99))
    aggregate = one(c.Aggregate, d.tick(10.0))
    assert [u.node_id for u in aggregate.updates] == ["a", "b"]
    assert [(f.node_id, f.reason) for f in aggregate.failures] == [("c", "late")]
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.1}))
    assert one(c.Record, d.log).record["late"] == ["c"]
    assert d.engine.participation.get("c").late == 1  # type: ignore[union-attr]


def test_sync_over_selection_closes_at_k_updates() -> None:
    """C = 0.5 of 4 live nodes is K = 2; over_selection 1.5 asks 3 and closes at the second update."""
    d = Driver(config(policy={"fraction": 0.5, "over_selection": 1.5}))
    d.start("a", "b", "c", "d")
    configure = _round(d)
    assert len(configure.tasks) == 3
    first, second, third = configure.tasks
    assert not of(c.Aggregate, d.feed(update(third)))
    aggregate = one(c.Aggregate, d.feed(update(first)))
    assert sorted(u.node_id for u in aggregate.updates) == sorted([first.node, third.node])
    assert [f.node_id for f in aggregate.failures] == [second.node]


def test_sync_node_going_offline_mid_round_is_lost_and_not_waited_for() -> None:
    """b's will fires: the round closes as soon as a and c answered, with b lost, long before the deadline."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    d.feed(update(tasks["a"]), at=0.5)
    d.feed(e.NodeSeen("b", False), at=0.6)
    aggregate = one(c.Aggregate, d.feed(update(tasks["c"]), at=0.7))
    assert [(f.node_id, f.reason) for f in aggregate.failures] == [("b", "lost")]
    d.feed(e.Aggregated(aggregate.step, {}))
    out = d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.2}))
    assert [t.node for t in one(c.Configure, out).tasks] == ["a", "c"], "round 1 sampled an offline node"


def test_sync_reported_failure_counts_as_an_answer() -> None:
    """A node that says its training failed is recorded failed; the round does not wait for it."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    d.feed(update(tasks["a"]))
    d.feed(failure(tasks["b"]))
    aggregate = one(c.Aggregate, d.feed(update(tasks["c"])))
    assert [(f.node_id, f.reason) for f in aggregate.failures] == [("b", "failed")]


def test_sync_insufficient_updates_retry_carries_the_accepted_then_skip_discards() -> None:
    """min_updates 3 with c lost: attempt 0 falls short, attempt 1 carries a and b and asks nobody
    new; at max_retries the round gives up and names the discarded updates."""
    d = Driver(config(policy={"min_updates": 3, "max_retries": 1}))
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    d.feed(update(tasks["a"]))
    d.feed(update(tasks["b"]))
    out = d.feed(e.NodeSeen("c", False))
    assert not of(c.Aggregate, out)
    record = one(c.Record, out).record
    assert (record["attempt"], record["aggregated"], record["lost"]) == (0, False, ["c"])
    retry = one(c.Configure, out)
    assert retry.ctx.round == 0 and retry.tasks == (), "the retry asked nodes whose updates were carried"
    out = d.feed(e.Configured(retry.step, inline=True))
    record = one(c.Record, out).record
    assert record["carried"] == ["a", "b"] and record["discarded"] == ["a", "b"] and not record["aggregated"]
    assert one(c.Configure, out).ctx.round == 1
    assert d.engine.participation.get("a").count == 0  # type: ignore[union-attr]


def test_sync_late_and_duplicate_updates_are_refused_with_reasons() -> None:
    """After the deadline, c's update gets a late receipt; a second update from a is a duplicate; an
    update quoting another task matches no round; none reaches an aggregation."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    d.feed(update(tasks["a"]))
    out = d.feed(update(tasks["a"]))
    assert one(c.Refused, out).reason == "duplicate-update" and not of(c.Receipt, out)
    d.feed(update(tasks["b"]))
    aggregate = one(c.Aggregate, d.tick(10.0))
    out = d.feed(update(tasks["c"]), at=10.5)
    assert one(c.Receipt, out).status == "late" and d.engine.late_arrivals == 1
    forged = update(tasks["c"])
    forged.message.meta["task"] = b"x" * 16  # type: ignore[index]
    assert one(c.Refused, d.feed(forged)).reason == "wrong-round"
    assert len(aggregate.updates) == 2


def test_sync_update_claiming_another_base_version_is_refused_as_wrong_version() -> None:
    """A node (or a forger) saying it trained from version 7 when the task carried 0: refused, receipt sent."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    out = d.feed(update(tasks["a"], base_version=7))
    assert one(c.Refused, out).reason == "wrong-base-version"
    assert one(c.Receipt, out).status == "rejected" and one(c.Receipt, out).reason == "wrong-base-version"


def test_sync_broadcast_waits_for_acks_or_the_ack_timeout_and_resends_to_a_late_ack() -> None:
    """A large model: published once when every node acknowledged, or at ack_timeout_s without b;
    b's late acknowledgement gets the model on its own topic."""
    d = Driver(config())
    d.start(*NODES)
    configure = _round(d, inline=False)
    tasks = {t.node: t for t in configure.tasks}
    d.feed(e.Acked("a", 0, tasks["a"].task))
    d.feed(e.Acked("c", 0, tasks["c"].task))
    assert not of(c.Broadcast, d.log) and d.engine.next_deadline() == pytest.approx(1.0)
    assert one(c.Broadcast, d.tick(1.0)).round == 0
    assert d.engine.next_deadline() == pytest.approx(10.0)
    assert one(c.Resend, d.feed(e.Acked("b", 0, tasks["b"].task), at=1.2)).node == "b"


def test_sync_broadcast_goes_out_as_soon_as_all_acknowledged() -> None:
    d = Driver(config())
    d.start("a", "b")
    tasks = {t.node: t for t in _round(d, inline=False).tasks}
    d.feed(e.Acked("a", 0, tasks["a"].task))
    assert one(c.Broadcast, d.feed(e.Acked("b", 0, tasks["b"].task), at=0.1)).round == 0


def test_sync_late_update_is_carried_with_its_staleness_when_asked() -> None:
    """late_updates: carry: c's update of round 0 arrives during round 1, is accepted, and is folded
    into round 1's aggregation with staleness 1 under the configured weight; b's fresh update of
    round 1 supersedes b's late one."""
    d = Driver(config(policy={"late_updates": "carry"}, staleness={"fn": "polynomial", "a": 0.5}))
    d.start(*NODES)
    round0 = {t.node: t for t in _round(d).tasks}
    d.feed(update(round0["a"]))
    aggregate = one(c.Aggregate, d.tick(10.0))
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.3}))
    round1 = {t.node: t for t in _round(d).tasks}
    assert one(c.Receipt, d.feed(update(round0["c"], value=3.0))).status == "received"
    d.feed(update(round0["b"], value=5.0))
    d.feed(update(round1["a"]))
    d.feed(update(round1["b"]))
    out = d.feed(failure(round1["c"]))
    aggregate = one(c.Aggregate, out)
    assert [(u.node_id, u.staleness, u.base_version) for u in aggregate.updates] == [
        ("a", 0, 1),
        ("b", 0, 1),
        ("c", 1, 0),
    ]
    assert aggregate.ctx.folding.staleness(1) == pytest.approx(2**-0.5)
    d.feed(e.Aggregated(aggregate.step, {}))
    record = one(c.Record, d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.4}))).record
    assert record["late_folded"] == ["c"] and record["superseded"] == ["b"]
    assert d.engine.participation.get("c").last_round == 1  # type: ignore[union-attr]


def test_a_late_partial_of_a_site_is_carried_and_never_superseded() -> None:
    """A site aggregator's partial (meta site: it speaks for 2 nodes) of round 0 comes during round 1:
    carried, and folded beside the site's fresh partial of round 1, not replaced by it (its nodes' work
    is other work); a second copy of it is a duplicate."""
    d = Driver(config(policy={"late_updates": "carry"}))
    d.start("s0", "s1")
    round0 = {t.node: t for t in _round(d).tasks}
    d.feed(update(round0["s1"], site={"nodes": 2}))
    aggregate = one(c.Aggregate, d.tick(10.0))
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.3}))
    round1 = {t.node: t for t in _round(d).tasks}
    late = update(round0["s0"], value=3.0, site={"nodes": 2})
    assert one(c.Receipt, d.feed(late)).status == "received"
    assert one(c.Refused, d.feed(e.UpdateArrived(replace(late.message, message_id=b"x" * 16), 0.0))).reason == (
        "duplicate-update"
    )
    d.feed(update(round1["s0"], site={"nodes": 2}))
    aggregate = one(c.Aggregate, d.feed(update(round1["s1"], site={"nodes": 2})))
    assert [(u.node_id, u.staleness, u.site_nodes) for u in aggregate.updates] == [
        ("s0", 0, 2), ("s0", 1, 2), ("s1", 0, 2),
    ]  # fmt: skip
    d.feed(e.Aggregated(aggregate.step, {}))
    record = one(c.Record, d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.4}))).record
    assert record["late_folded"] == ["s0@0"] and record["superseded"] == []


def test_sync_late_update_too_stale_to_carry_is_refused() -> None:
    d = Driver(config(policy={"late_updates": "carry"}, max_staleness=0))
    d.start("a", "b")
    round0 = {t.node: t for t in _round(d).tasks}
    d.feed(update(round0["a"]))
    aggregate = one(c.Aggregate, d.tick(10.0))
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.3}))
    out = d.feed(update(round0["b"]))
    assert one(c.Refused, out).reason == "stale"


def test_sync_waiting_for_nodes_fails_after_wait_for_nodes_s() -> None:
    d = Driver(config(policy={"min_nodes": 2}))
    d.start("a")
    assert d.engine.next_deadline() == pytest.approx(30.0)
    finish = one(c.Finish, d.tick(30.0))
    assert finish.state == "failed" and "only 1 of the 2 nodes" in finish.error and d.engine.finished


def test_sync_run_finishes_after_the_last_round_and_refuses_what_comes_after() -> None:
    d = Driver(config(rounds=1), evaluates=False)
    d.start("a")
    spec = _round(d).tasks[0]
    aggregate = one(c.Aggregate, d.feed(update(spec)))
    out = d.feed(e.Aggregated(aggregate.step, {}))
    assert not of(c.Evaluate, out) and one(c.Finish, out).state == "finished"
    assert one(c.Refused, d.feed(update(spec))).reason == "finished"


def test_sync_resume_continues_after_the_checkpointed_round() -> None:
    """The checkpoint meta of round 1 restores round, version and record into a new engine."""
    d = Driver(config(rounds=4))
    d.start("a")
    for _ in range(2):
        spec = _round(d).tasks[0]
        aggregate = one(c.Aggregate, d.feed(update(spec)))
        d.feed(e.Aggregated(aggregate.step, {}))
        d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))
    meta = of(c.Checkpoint, d.log)[-1].meta
    assert (meta["round"], meta["model_version"], meta["engine"]) == (1, 2, "sync")
    resumed = Driver(config(rounds=4))
    assert isinstance(resumed.engine, SyncRounds)
    resumed.engine.restore(meta)
    configure = one(c.Configure, resumed.start("a"))
    assert configure.ctx.round == 2 and configure.tasks[0].version == 2
    assert resumed.engine.participation.get("a").count == 2  # type: ignore[union-attr]


def test_sync_a_round_counts_as_completed_with_its_checkpoint_not_before() -> None:
    """A stop while round 1's model is being evaluated: the summary's rounds_completed is the rounds
    checkpointed (1), so a drained daemon's summary says what --resume continues from."""
    d = Driver(config(rounds=4))
    d.start("a")
    aggregate = one(c.Aggregate, d.feed(update(_round(d).tasks[0])))
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))
    assert d.engine.summary_fields()["rounds_completed"] == 1 == len(of(c.Checkpoint, d.log))
    aggregate = one(c.Aggregate, d.feed(update(_round(d).tasks[0])))
    one(c.Evaluate, d.feed(e.Aggregated(aggregate.step, {})))
    assert d.engine.summary_fields()["rounds_completed"] == 1, "counted before its evaluation and checkpoint"
    assert one(c.Finish, d.feed(e.Stop())).state == "stopped"
    assert d.engine.summary_fields()["rounds_completed"] == 1 == len(of(c.Checkpoint, d.log))


def test_sync_stop_finishes_stopped() -> None:
    d = Driver(config())
    d.start("a")
    assert one(c.Finish, d.feed(e.Stop())).state == "stopped" and d.engine.state == "stopped"


def test_sync_closed_rounds_keep_who_answered_but_not_their_tensors() -> None:
    """The engine remembers 64 closed attempts for late and duplicate updates, without the models."""
    d = Driver(config(rounds=3))
    d.start("a")
    spec = _round(d).tasks[0]
    aggregate = one(c.Aggregate, d.feed(update(spec)))
    assert aggregate.updates[0].payload.tensors, "the aggregation got no tensors"
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))
    _round(d)
    assert isinstance(d.engine, SyncRounds)
    past = d.engine._past[-1]
    assert past.accepted["a"].payload.tensors == {} and past.answered("a")
    assert one(c.Refused, d.feed(update(spec))).reason == "duplicate-update"


def test_sync_receipts_for_refusals_only_skip_the_accepted() -> None:
    """policy.receipts: refusals: an accepted update gets no receipt, a refused one still does."""
    d = Driver(config(policy={"receipts": "refusals"}))
    d.start("a", "b")
    tasks = {t.node: t for t in _round(d).tasks}
    assert not of(c.Receipt, d.feed(update(tasks["a"])))
    assert one(c.Receipt, d.feed(update(tasks["b"], base_version=5))).status == "rejected"


# -- trusting less: sample counts, and refused messages that do not answer for a node ---------------


def test_sync_forged_update_does_not_block_the_real_one() -> None:
    """A forged update on a's behalf (10^11 samples) is refused with a receipt and the reason; a's
    real update for the same task is then accepted, the round closes when all answered, no one rejected."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    out = d.feed(update(tasks["a"], value=1e6, samples=10**11), at=0.5)
    assert one(c.Refused, out).reason == "samples-mismatch" and one(c.Receipt, out).reason == "samples-mismatch"
    wrong = update(tasks["b"])
    object.__setattr__(wrong.message, "tensors", {"model/w": wrong.message.tensors["model/w"][:1]})
    assert one(c.Refused, d.feed(wrong)).reason == "wrong-shape"
    d.feed(update(tasks["a"]), at=1.0)
    d.feed(update(tasks["b"]), at=1.5)
    aggregate = one(c.Aggregate, d.feed(update(tasks["c"]), at=2.0))
    assert [(u.node_id, u.num_samples) for u in aggregate.updates] == [("a", 10), ("b", 10), ("c", 10)]
    assert aggregate.failures == []
    d.feed(e.Aggregated(aggregate.step, {}))
    record = one(c.Record, d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.9}))).record
    assert record["accepted"] == list(NODES) and record["rejected"] == []
    assert d.engine.refused == {"samples-mismatch": 1, "wrong-shape": 1}
    assert d.engine.participation.get("a").rejected == 0  # type: ignore[union-attr]


def test_sync_each_node_gets_its_own_task_id_and_one_quoting_anothers_is_refused() -> None:
    """Issue 31, item 4: an attempt's nodes used to share one task id, which the model broadcast
    carried, so a node publishing as another quoted a valid id. Each node's id is now its own
    (derived from the attempt's secret, which is never sent), the broadcast's model id is none of
    them, and an ack or update quoting another node's id, or the model id, is refused as
    foreign-task (no receipt: its sender is not who the id was for) and answers nothing."""
    d = Driver(config())
    d.start(*NODES)
    configure = _round(d)
    tasks = {t.node: t for t in configure.tasks}
    ids = [t.task for t in configure.tasks]
    assert len(set(ids)) == len(ids) == 3 and all(len(i) == 16 for i in ids)
    model = {t.model for t in configure.tasks}
    assert len(model) == 1 and None not in model and not model & set(ids)
    assert d.engine.current is not None and d.engine.current.task_id not in ids  # the secret stays home
    for quoted in (tasks["b"].task, tasks["a"].model):
        out = d.feed(update(dataclasses.replace(tasks["a"], task=quoted), value=1e6))
        refused = one(c.Refused, out)
        assert refused.reason == "foreign-task" and refused.node == "a" and not of(c.Receipt, out)
        assert one(c.Refused, d.feed(e.Acked("a", 0, quoted))).reason == "foreign-task"
    assert not of(c.Refused, d.feed(e.Acked("a", 0, tasks["a"].task)))
    d.feed(update(tasks["a"]), at=1.0)
    d.feed(update(tasks["b"]), at=1.5)
    aggregate = one(c.Aggregate, d.feed(update(tasks["c"]), at=2.0))
    assert [(u.node_id, u.num_samples) for u in aggregate.updates] == [("a", 10), ("b", 10), ("c", 10)]
    assert d.engine.refused == {"foreign-task": 4}
    # the next attempt's ids are new ones: an old id is no one's now
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.9}))
    following = {t.node: t.task for t in _round(d).tasks}
    assert not set(following.values()) & set(ids)


def test_sync_update_claiming_more_samples_than_announced_is_refused_and_as_many_accepted() -> None:
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    out = d.feed(update(tasks["a"], samples=SAMPLES + 1))
    assert one(c.Refused, out).reason == "samples-mismatch" and one(c.Receipt, out).status == "rejected"
    assert one(c.Receipt, d.feed(update(tasks["a"], samples=SAMPLES))).status == "received"


def test_sync_invalid_update_of_an_honest_node_waits_for_the_deadline_and_is_rejected_once() -> None:
    """c's only update holds NaN: the round waits for c until the deadline (c might yet send a valid
    one), then closes with c rejected, once in the record, the participation and the failures."""
    d = Driver(config())
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d).tasks}
    d.feed(update(tasks["a"]), at=1.0)
    d.feed(update(tasks["b"]), at=1.0)
    assert one(c.Refused, d.feed(update(tasks["c"], value=float("nan")), at=2.0)).reason == "non-finite"
    assert one(c.Refused, d.feed(update(tasks["c"], value=float("inf")), at=3.0)).reason == "non-finite"
    assert not of(c.Aggregate, d.log) and d.engine.next_deadline() == pytest.approx(10.0)
    aggregate = one(c.Aggregate, d.tick(10.0))
    assert [u.node_id for u in aggregate.updates] == ["a", "b"]
    assert [(f.node_id, f.reason) for f in aggregate.failures] == [("c", "rejected")]
    d.feed(e.Aggregated(aggregate.step, {}))
    record = one(c.Record, d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))).record
    assert (record["rejected"], record["late"], record["lost"]) == (["c"], [], [])
    assert d.engine.participation.get("c").rejected == 1 and d.engine.refused["non-finite"] == 2  # type: ignore[union-attr]


def test_sync_announcement_above_max_node_samples_is_refused_and_the_node_never_goes_live() -> None:
    d = Driver(config(policy={"max_node_samples": 50}))
    out = d.start("a", "b", samples=40)
    out += d.feed(seen("c", samples=10**11))
    assert one(c.Refused, out).reason == "samples-over-limit" and "c" not in d.engine.live
    tasks = {t.node: t for t in _round(d).tasks}
    assert set(tasks) == {"a", "b"}
    assert one(c.Refused, d.feed(update(tasks["a"], samples=41))).reason == "samples-mismatch"
    assert one(c.Receipt, d.feed(update(tasks["a"], samples=40))).status == "received"


def test_sync_each_nodes_own_limit_bounds_its_announcement_and_its_updates() -> None:
    """Issue 31, item 1: an insider announced 10^11 samples in its own status and claimed them in its
    update, accepted because only its own announcement checked the claim. With per-node limits (its
    shard), a node announcing more than its shard never goes live; one within it is bounded by both."""
    cfg = dataclasses.replace(
        config(policy={"max_node_samples": 1000, "min_nodes": 3}), node_samples={"a": 40, "b": 60}
    )
    d = Driver(cfg)
    out = d.start("a", samples=40)
    out += d.feed(seen("b", samples=10**11))
    refused = one(c.Refused, out)
    assert refused.reason == "samples-over-limit" and refused.node == "b" and "limit of 60" in refused.detail
    assert "b" not in d.engine.live and cfg.sample_limit("c") == 1000  # a node not named: the policy's
    out = d.feed(seen("b", samples=60)) + d.feed(seen("c", samples=999))
    assert not of(c.Refused, out) and d.engine.live == {"a", "b", "c"}
    tasks = {t.node: t for t in _round(d).tasks}
    assert one(c.Refused, d.feed(update(tasks["b"], samples=61))).reason == "samples-over-limit"
    assert one(c.Receipt, d.feed(update(tasks["b"], samples=60))).status == "received"


def test_sync_node_that_announced_no_count_is_refused_unless_allowed_then_bounded_by_the_limit() -> None:
    """No announced count: refused as samples-unannounced by default; with require_announced_samples
    off, accepted up to max_node_samples, refused above it."""
    d = Driver(config())
    d.start("a", samples=None)
    (task,) = _round(d).tasks
    out = d.feed(update(task))
    assert one(c.Refused, out).reason == "samples-unannounced" and one(c.Receipt, out).status == "rejected"

    d = Driver(config(policy={"require_announced_samples": False, "max_node_samples": 1000}))
    d.start("a", "b", samples=None)
    tasks = {t.node: t for t in _round(d).tasks}
    assert one(c.Refused, d.feed(update(tasks["a"], samples=1001))).reason == "samples-over-limit"
    assert one(c.Receipt, d.feed(update(tasks["a"], samples=1000))).status == "received"


def test_sync_a_later_announcement_replaces_the_count() -> None:
    """The latest online status counts (a node restarted with other data); an offline one changes nothing."""
    d = Driver(config())
    d.start("a", samples=10)
    d.feed(seen("a", samples=20))
    d.feed(seen("a", False, samples=None))
    d.feed(seen("a", samples=30))
    assert d.engine.announced == {"a": 30}


def test_sync_ack_timeout_at_or_past_the_deadline_is_shortened_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31: with deadline_s at or below ack_timeout_s, a broadcast round that selected a silent
    node published its model only at the deadline, so nobody could answer. The policy halves the wait
    (with a warning); the round then broadcasts in time and takes the two answers that come."""
    d = Driver(config(policy={"deadline_s": 4.0, "ack_timeout_s": 5.0}))
    assert d.engine.policy.ack_timeout_s == 2.0  # type: ignore[attr-defined]
    assert "not below deadline_s" in caplog.text
    d.start(*NODES)
    tasks = {t.node: t for t in _round(d, inline=False).tasks}
    d.feed(e.Acked("a", 0, tasks["a"].task))
    d.feed(e.Acked("b", 0, tasks["b"].task))  # c is silent
    assert one(c.Broadcast, d.tick(2.0)).round == 0
    d.feed(update(tasks["a"]), at=2.5)
    d.feed(update(tasks["b"]), at=3.0)
    assert [u.node_id for u in one(c.Aggregate, d.tick(4.0)).updates] == ["a", "b"]


def _through_aggregation(d: Driver, answer: tuple[str, ...]) -> c.Aggregate:
    """Configure the pending attempt, let `answer` send their updates; the Aggregate that follows."""
    tasks = {t.node: t for t in _round(d).tasks}
    out: list[c.Command] = []
    for node in answer:
        out += d.feed(update(tasks[node]))
    return one(c.Aggregate, out)


def test_sync_a_model_holding_nan_is_rejected_and_the_round_runs_again_on_the_last_good_one() -> None:
    """Issue 31, item 2: the half reports its aggregate held NaN or inf (it fell back already): the
    version does not move, nothing is evaluated, the round's updates are named as suspects and the
    round is attempted again."""
    d = Driver(config(policy={"min_nodes": 3}))
    d.start(*NODES)
    aggregate = _through_aggregation(d, NODES)
    out = d.feed(e.Aggregated(aggregate.step, {}, "sha", rejected="non-finite (w)"))
    record = one(c.Record, out).record
    assert record["aggregated"] is False and record["model_rejected"] == "the aggregated model holds non-finite (w)"
    assert record["suspects"] == sorted(NODES) and record["model_version"] == 0
    assert not of(c.Evaluate, out) and not of(c.Rollback, out)  # the half is back on the good model already
    retry = one(c.Configure, out)
    assert retry.ctx.round == 0 and {t.attempt for t in retry.tasks} == {1} and d.engine.version == 0


def test_sync_a_collapsed_evaluation_rolls_the_model_back_and_excludes_the_outlier() -> None:
    """With reject_below 0.5, a round whose model scores under half the best so far is rolled back
    (Rollback before the next Configure); its updates are all suspects, but only the one whose norm
    stands out (c's, 1000 times the others') counts towards exclude_after 1: c gets no more tasks."""
    d = Driver(config(rounds=3, policy={"min_nodes": 3, "reject_below": 0.5, "exclude_after": 1}))
    d.start(*NODES)
    d.feed(e.Aggregated(_through_aggregation(d, NODES).step, {}))
    d.feed(e.Evaluated(of(c.Evaluate, d.log)[-1].step, {"accuracy": 0.8}))  # round 0: the best so far
    tasks = {t.node: t for t in _round(d).tasks}
    out = d.feed(update(tasks["a"])) + d.feed(update(tasks["b"])) + d.feed(update(tasks["c"], value=-1000.0))
    aggregate = one(c.Aggregate, out)
    d.feed(e.Aggregated(aggregate.step, {}))
    assert d.engine.version == 2
    out = d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.1}))
    rollback = one(c.Rollback, out)
    assert rollback.step == aggregate.step and "0.1000 fell below 0.5 of the best so far, 0.8000" in rollback.reason
    retry = one(c.Configure, out)
    assert out.index(rollback) < out.index(retry) and d.engine.version == 1
    record = one(c.Record, out).record
    assert record["model_rejected"] == rollback.reason and record["suspects"] == ["a", "b", "c"]
    assert record["outliers"] == ["c"] and record["excluded"] == ["c"]
    assert record["accuracy"] == 0.1 and d.engine.accuracies == [(0, 0.8)]
    assert retry.ctx.round == 1 and [t.node for t in retry.tasks] == ["a", "b"]  # c gets no more tasks
    meta = d.engine.checkpoint_meta()  # a resumed run remembers it
    assert meta["excluded"] == ["c"] and meta["rejected_models"] == {"c": 1}


def test_sync_a_run_whose_every_live_node_is_excluded_fails_saying_so() -> None:
    d = Driver(config(rounds=3, policy={"min_nodes": 3, "reject_below": 0.5, "exclude_after": 1}))
    d.start(*NODES)
    d.engine.excluded.update(NODES)  # as after rejected models
    d.feed(e.Aggregated(_through_aggregation(d, NODES).step, {}))
    out = d.feed(e.Evaluated(of(c.Evaluate, d.log)[-1].step, {"accuracy": 0.8}))
    finish = one(c.Finish, out)
    assert finish.state == "failed" and "every live node is excluded after rejected models: a, b, c" in finish.error


def test_sync_a_federation_that_cannot_progress_fails_after_the_bound_saying_why() -> None:
    """Issue 31, item 2: rounds that never gathered min_updates (the honest nodes trained to NaN after
    a poisoned model) were retried and moved past for ever, each waiting out its deadline. After
    max_rounds_without_model rounds in a row without a model the run fails, and says why."""
    d = Driver(
        config(rounds=50, policy={"min_nodes": 3, "min_updates": 3, "max_retries": 0, "max_rounds_without_model": 2})
    )
    d.start(*NODES)
    for round_ in range(2):
        tasks = {t.node: t for t in _round(d).tasks}
        d.feed(update(tasks["a"]), at=20.0 * round_ + 1)  # one of the three needed
        out = d.tick(20.0 * round_ + 15)
    finish = one(c.Finish, out)
    assert finish.state == "failed" and d.engine.state == "failed"
    assert finish.error.startswith(
        "2 rounds in a row ended without a new model (the last, round 1: 1 update(s) accepted"
    )
    assert "min_updates is 3" in finish.error and not of(c.Configure, out)


@pytest.mark.parametrize(
    ("eval_every", "eval_last", "evaluated"),
    [(3, 0, [2, 5, 6]), (3, 2, [2, 5, 6]), (3, 3, [2, 4, 5, 6]), (1, 2, [0, 1, 2, 3, 4, 5, 6]), (10, 4, [3, 4, 5, 6])],
)
def test_sync_evaluates_every_eval_every_rounds_and_each_of_the_last_eval_last(
    eval_every: int, eval_last: int, evaluated: list[int]
) -> None:
    """Seven rounds: Evaluate after every eval_every-th round, each of the last eval_last, and the last
    (a metric over the last K rounds stays exact with sparse evaluations before them)."""
    d = Driver(dataclasses.replace(config(rounds=7), eval_every=eval_every, eval_last=eval_last))
    d.start(*NODES)
    got = []
    for rnd in range(7):
        configure = _round(d)
        assert configure.ctx.round == rnd
        for task in configure.tasks[:-1]:
            d.feed(update(task))
        aggregate = one(c.Aggregate, d.feed(update(configure.tasks[-1])))
        out = d.feed(e.Aggregated(aggregate.step, {}))
        if of(c.Evaluate, out):
            got.append(rnd)
            d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))
    assert got == evaluated
