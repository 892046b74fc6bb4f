"""BufferedAsync on a fake clock: slots, versions, staleness, the buffer, refusals, deadlines, the end."""

from __future__ import annotations

import pytest

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.buffered import BufferedAsync
from tests.coordinator.engine_helpers import SAMPLES, Driver, config, failure, of, one, update

NODES = ("a", "b", "c", "d", "e")


def _driver(evaluates: bool = False, **policy: object) -> Driver:
    options = {"buffer": 2, "concurrency": 3, "max_staleness": 5, "aggregations": 10, "deadline_s": 20.0} | policy
    d = Driver(config(engine="async", **options), evaluates=evaluates)
    assert isinstance(d.engine, BufferedAsync)
    return d


def _configure(d: Driver, out: list[c.Command] | None = None) -> list[c.TaskSpec]:
    """Configure every pending Configure in `out` (default: the log's last) and return its tasks."""
    tasks = []
    for configure in of(c.Configure, out if out is not None else d.log[-1:]):
        d.feed(e.Configured(configure.step, inline=True))
        tasks += configure.tasks
    return tasks


def _busy(d: Driver) -> set[str]:
    assert isinstance(d.engine, BufferedAsync)
    return set(d.engine.by_node)


def test_async_start_fills_the_slots_with_a_seeded_draw_of_inline_tasks() -> None:
    """concurrency 3 of 5 live nodes: one Configure of 3 tasks at version 0, each its own id, every
    model inside its task; the same arrivals give the same draw."""
    d = _driver()
    configure = one(c.Configure, d.start(*NODES))
    assert len(configure.tasks) == 3 and configure.inline_only
    assert {t.version for t in configure.tasks} == {0} and len({t.task for t in configure.tasks}) == 3
    again = one(c.Configure, _driver().start(*NODES))
    assert [t.node for t in again.tasks] == [t.node for t in configure.tasks]
    out = d.feed(e.Configured(configure.step, inline=True))
    assert [s.node for s in of(c.SendTask, out)] == [t.node for t in configure.tasks]


def test_async_tasks_expire_after_the_async_deadline() -> None:
    """The engine decides when a task goes stale (issue 30, item 4): its Configure carries the
    asynchronous deadline_s (20 s here), which the daemon sets as the tasks' MQTT expiry and each
    task's deadline, not the synchronous policy's (10 s)."""
    d = _driver()
    configure = one(c.Configure, d.start(*NODES))
    assert configure.expiry_s == 20.0 and d.engine.policy.deadline_s == 10.0


def test_async_delivery_refills_the_slot_at_once_and_no_node_holds_two_tasks() -> None:
    """A delivery frees its slot and a new task goes to an idle node; slots freed while that task is
    prepared are filled together once it is (one Configure in flight)."""
    d = _driver()
    tasks = _configure(d, d.start(*NODES))
    out = d.feed(update(tasks[0]), at=1.0)
    assert one(c.Receipt, out).status == "received"
    refill = one(c.Configure, out)
    assert len(refill.tasks) == 1 and refill.tasks[0].node not in {t.node for t in tasks[1:]}
    assert not of(c.Configure, d.feed(update(tasks[1]))), "a second Configure while one is prepared"
    out = d.feed(e.Configured(refill.step, inline=True))
    assert len(one(c.Configure, out).tasks) == 1, "the slot freed meanwhile was not filled"
    _configure(d, out)
    assert len(_busy(d)) == 3


def test_async_every_k_updates_fold_into_a_new_version_with_staleness() -> None:
    """K = 2: the second update triggers one Aggregate (FedBuff rule, bases given) of both, each with
    staleness 0; the version moves on when Aggregated comes back; tasks configured meanwhile carry it."""
    d = _driver()
    tasks = _configure(d, d.start(*NODES))
    out = d.feed(update(tasks[0]))
    assert not of(c.Aggregate, out)
    _configure(d, out)
    out = d.feed(update(tasks[1]))
    aggregate = one(c.Aggregate, out)
    assert aggregate.ctx.folding.rule == "fedbuff" and aggregate.bases == (0,)
    assert [u.staleness for u in aggregate.updates] == [0, 0] and aggregate.ctx.round == 0
    assert {t.version for t in one(c.Configure, out).tasks} == {1}, "a task configured during the fold must carry v+1"
    out = d.feed(e.Aggregated(aggregate.step, {"train_loss": 0.3}))
    record = one(c.Record, out).record
    assert (record["round"], record["version"], record["model_version"]) == (0, 1, 1)
    assert record["staleness_mean"] == 0 and record["train_loss"] == 0.3
    assert d.engine.version == 1 and d.engine.participation.get(tasks[0].node).last_round == 0  # type: ignore[union-attr]


def test_async_buffer_of_one_is_fedasync_and_staleness_counts_versions_behind() -> None:
    """K = 1: each update is its own version (FedAsync's rule); the slow node's update, trained from
    version 0, is folded at version 2 with staleness 2, after the fast node delivered twice."""
    d = _driver(buffer=1, concurrency=2)
    slow, fast = _configure(d, d.start("a", "b"))
    for version in (0, 1):
        out = d.feed(update(fast))
        aggregate = one(c.Aggregate, out)
        assert aggregate.ctx.folding.rule == "fedasync" and aggregate.bases == () and aggregate.ctx.version == version
        (fast,) = _configure(d, out)
        assert fast.version == version + 1
        d.feed(e.Aggregated(aggregate.step, {}))
    aggregate = one(c.Aggregate, d.feed(update(slow)))
    assert aggregate.updates[0].staleness == 2 and aggregate.updates[0].base_version == 0


def test_async_update_staler_than_max_staleness_is_refused_and_recorded() -> None:
    d = _driver(buffer=1, concurrency=2, max_staleness=0)
    slow, fast = _configure(d, d.start("a", "b"))
    out = d.feed(update(fast))
    _configure(d, out)
    d.feed(e.Aggregated(one(c.Aggregate, out).step, {}))
    out = d.feed(update(slow))
    assert one(c.Refused, out).reason == "stale" and one(c.Receipt, out).status == "stale"
    assert not of(c.Aggregate, out) and d.engine.participation.get(slow.node).late == 1  # type: ignore[union-attr]
    assert one(c.Configure, out).tasks[0].version == 1, "the slot was not refilled"


def test_async_task_past_its_deadline_expires_its_slot_is_refilled_and_its_update_refused() -> None:
    d = _driver(concurrency=2)
    first, _ = _configure(d, d.start("a", "b", "c"))
    assert d.engine.next_deadline() == pytest.approx(20.0)
    out = d.tick(20.0)
    assert len(one(c.Configure, out).tasks) == 2, "both expired slots must be refilled"
    late = d.feed(update(first), at=21.0)
    assert one(c.Refused, late).reason == "expired" and one(c.Receipt, late).status == "late"
    assert d.engine.participation.get(first.node).late == 1  # type: ignore[union-attr]


def test_async_node_going_offline_loses_its_task_and_is_replaced() -> None:
    d = _driver(concurrency=2)
    tasks = _configure(d, d.start("a", "b", "c"))
    gone = tasks[0].node
    out = d.feed(e.NodeSeen(gone, False))
    replacement = one(c.Configure, out).tasks[0]
    assert replacement.node != gone and d.engine.participation.get(gone).lost == 1  # type: ignore[union-attr]


def test_async_forged_duplicate_and_unknown_updates_are_refused_with_reasons() -> None:
    """Another node's task, a header version that is not the task's, a missing base_version, a second
    update for one task, a task never sent: each refused, counted, and nothing is folded."""
    d = _driver(buffer=5)
    a, b, cc = _configure(d, d.start("a", "b", "c"))
    forged = update(a)
    object.__setattr__(forged.message, "sender", b.node)
    assert one(c.Refused, d.feed(forged)).reason == "foreign-task"
    wrong = update(b)
    object.__setattr__(wrong.message, "round", 7)
    assert one(c.Refused, d.feed(wrong)).reason == "wrong-base-version"
    assert one(c.Refused, d.feed(update(cc, base_version=None))).reason == "wrong-base-version"
    d.feed(update(a))
    assert one(c.Refused, d.feed(update(a))).reason == "duplicate-update"
    unknown = update(a)
    unknown.message.meta["task"] = b"z" * 16  # type: ignore[index]
    assert one(c.Refused, d.feed(unknown)).reason == "wrong-round"
    assert isinstance(d.engine, BufferedAsync) and len(d.engine.buffer) == 1 and not of(c.Aggregate, d.log)


def test_async_reported_failure_frees_the_slot_and_is_passed_as_a_failure() -> None:
    d = _driver()
    a, b, cc = _configure(d, d.start("a", "b", "c"))
    assert of(c.Configure, d.feed(failure(a)))
    d.feed(update(b))
    aggregate = one(c.Aggregate, d.feed(update(cc)))
    assert [(f.node_id, f.reason) for f in aggregate.failures] == [(a.node, "failed")]


def test_async_evaluation_pauses_folding_and_checkpoints_the_version_it_names() -> None:
    """eval_every 1: after Aggregated comes Evaluate; updates keep arriving and are buffered but not
    folded until Evaluated, which brings the Record, the Checkpoint and the next fold."""
    d = _driver(evaluates=True, buffer=1, concurrency=3)
    a, b, _ = _configure(d, d.start("a", "b", "c"))
    aggregate = one(c.Aggregate, d.feed(update(a)))
    evaluate = one(c.Evaluate, d.feed(e.Aggregated(aggregate.step, {})))
    assert not of(c.Aggregate, d.feed(update(b))), "folded while evaluating"
    out = d.feed(e.Evaluated(evaluate.step, {"accuracy": 0.6}))
    assert one(c.Record, out).record["accuracy"] == 0.6 and one(c.Checkpoint, out).key == 0
    nxt = one(c.Aggregate, out)
    assert nxt.ctx.version == 1 and nxt.updates[0].node_id == b.node and nxt.updates[0].staleness == 1


def test_async_run_ends_at_the_last_version_and_refuses_what_comes_after() -> None:
    """aggregations 1: the fold that makes version 1 is the last; an update arriving during it is
    refused as finished (not accepted, so none is dropped); then Finish."""
    d = _driver(aggregations=1)
    a, b, cc = _configure(d, d.start("a", "b", "c"))
    d.feed(update(a))
    aggregate = one(c.Aggregate, d.feed(update(b)))
    assert one(c.Refused, d.feed(update(cc))).reason == "finished"
    out = d.feed(e.Aggregated(aggregate.step, {}))
    assert one(c.Finish, out).state == "finished" and one(c.Checkpoint, out).meta["engine"] == "async"
    assert d.engine.summary_fields()["buffered_at_end"] == 0


def test_async_stop_folds_the_partial_buffer_first() -> None:
    """Stopping with one accepted update buffered (K = 2): it is folded (flush) before Finish."""
    d = _driver()
    a, *_ = _configure(d, d.start("a", "b", "c"))
    d.feed(update(a))
    aggregate = one(c.Aggregate, d.feed(e.Stop()))
    assert [u.node_id for u in aggregate.updates] == [a.node]
    out = d.feed(e.Aggregated(aggregate.step, {}))
    assert one(c.Record, out).record["flush"] and one(c.Finish, out).state == "stopped"


def test_async_a_node_twice_in_one_buffer_is_folded_twice_and_counted_twice() -> None:
    """K = 3 with two nodes: a delivers, is re-tasked at the same version and delivers again before
    the buffer fills: both its updates are folded, its second task trained from another seed."""
    d = _driver(buffer=3, concurrency=2)
    first = _configure(d, d.start("a", "b"))
    a = next(t for t in first if t.node == "a")
    out = d.feed(update(a))
    again = _configure(d, out)
    assert again[0].node == "a" and again[0].attempt == 1 and again[0].version == 0
    d.feed(update(again[0]))
    aggregate = one(c.Aggregate, d.feed(update(next(t for t in first if t.node == "b"))))
    assert [u.node_id for u in aggregate.updates] == ["a", "a", "b"]
    assert d.engine.participation.get("a").count == 2  # type: ignore[union-attr]


def test_async_resume_restores_version_record_and_draws() -> None:
    d = _driver(evaluates=True, buffer=1)
    a, *_ = _configure(d, d.start(*NODES))
    aggregate = one(c.Aggregate, d.feed(update(a)))
    d.feed(e.Aggregated(aggregate.step, {}))
    d.feed(e.Evaluated(aggregate.step, {"accuracy": 0.5}))
    meta = one(c.Checkpoint, d.log).meta
    resumed = _driver(evaluates=True, buffer=1)
    resumed.engine.restore(meta)
    configure = one(c.Configure, resumed.start(*NODES))
    assert {t.version for t in configure.tasks} == {1} and resumed.engine.accuracies == [(0, 0.5)]


def test_async_backpressure_holds_new_tasks_while_a_full_batch_waits() -> None:
    """K = 1: while the first fold runs, a second update fills the buffer: its slot is not refilled
    until that batch is folded, so the buffer never grows past what folding keeps up with."""
    d = _driver(buffer=1, concurrency=3)
    a, b, _ = _configure(d, d.start("a", "b", "c", "d"))
    out = d.feed(update(a))
    first = one(c.Aggregate, out)
    _configure(d, out)
    out = d.feed(update(b))
    assert not of(c.Configure, out) and not of(c.Aggregate, out), "refilled while a full batch waited"
    out = d.feed(e.Aggregated(first.step, {}))
    assert one(c.Aggregate, out).updates[0].node_id == b.node and of(c.Configure, out)


def test_async_staleness_counts_the_versions_its_place_in_the_buffer_implies() -> None:
    """max_staleness 1, K = 1: an update that would be folded two versions on (one fold running, one
    batch ahead of it) is refused on arrival, so nothing is folded staler than the bound."""
    d = _driver(buffer=1, concurrency=3, max_staleness=1)
    a, b, cc = _configure(d, d.start("a", "b", "c"))
    one(c.Aggregate, d.feed(update(a)))
    assert not of(c.Refused, d.feed(update(b))), "one version ahead is within the bound"
    out = d.feed(update(cc))
    assert one(c.Refused, out).reason == "stale" and "2 behind" in one(c.Refused, out).detail


def test_async_last_version_folds_everything_accepted() -> None:
    """Folding pauses during an evaluation, so two updates wait when the last version is made: it
    folds both (a partial batch of more than K), and the run ends with an empty buffer."""
    d = _driver(evaluates=True, buffer=1, concurrency=3, aggregations=2, max_staleness=5)
    a, b, cc = _configure(d, d.start("a", "b", "c"))
    aggregate = one(c.Aggregate, d.feed(update(a)))
    evaluate = one(c.Evaluate, d.feed(e.Aggregated(aggregate.step, {})))
    d.feed(update(b))
    d.feed(update(cc))
    last = one(c.Aggregate, d.feed(e.Evaluated(evaluate.step, {"accuracy": 0.5})))
    assert sorted(u.node_id for u in last.updates) == ["b", "c"]
    out = d.feed(e.Aggregated(last.step, {}))
    out += d.feed(e.Evaluated(last.step, {"accuracy": 0.6}))
    assert one(c.Finish, out).state == "finished" and d.engine.summary_fields()["buffered_at_end"] == 0


def test_async_participation_changes_wait_for_the_running_aggregation() -> None:
    """The record the aggregation reads in its thread does not change under it: a selection made while
    it runs is written once it is done."""
    d = _driver(buffer=1, concurrency=2)
    a, _ = _configure(d, d.start("a", "b", "c"))
    out = d.feed(update(a))
    aggregate = one(c.Aggregate, out)
    assert aggregate.ctx.participation is d.engine.participation, "the record was copied"
    configure = one(c.Configure, out)
    node = configure.tasks[0].node

    def selections() -> int:
        record = d.engine.participation.get(node)
        return 0 if record is None else record.rounds_selected

    prior = selections()
    d.feed(e.Configured(configure.step, inline=True))
    assert selections() == prior, "the record changed while the aggregation read it"
    d.feed(e.Aggregated(aggregate.step, {}))
    assert selections() == prior + 1


def test_async_records_time_from_a_clock_that_starts_at_zero() -> None:
    """ended_s counts from Start even when the clock's Start is at 0.0."""
    d = _driver(buffer=1)
    a, *_ = _configure(d, d.start("a", "b", "c"))
    aggregate = one(c.Aggregate, d.feed(update(a), at=2.5))
    record = one(c.Record, d.feed(e.Aggregated(aggregate.step, {}), at=3.0)).record
    assert record["ended_s"] == 3.0 and record["round_seconds"] == 3.0


# -- trusting less: refused messages leave the task open ----------------------------------------------


def test_async_forged_update_leaves_the_task_open_for_the_real_one() -> None:
    """A forged update (10^11 samples) for a's task is refused and a keeps its task and its slot; a's
    real update is then accepted; nothing is recorded rejected."""
    d = _driver(buffer=5)
    a, *_ = _configure(d, d.start("a", "b", "c"))
    out = d.feed(update(a, value=1e6, samples=10**11), at=1.0)
    assert one(c.Refused, out).reason == "samples-mismatch" and one(c.Receipt, out).status == "rejected"
    assert not of(c.Configure, out) and _busy(d) == {"a", "b", "c"}, "the refusal ended a's task"
    assert one(c.Receipt, d.feed(update(a), at=2.0)).status == "received"
    assert one(c.Refused, d.feed(update(a), at=2.5)).reason == "duplicate-update"
    assert isinstance(d.engine, BufferedAsync)
    assert [u.num_samples for u in d.engine.buffer] == [10] and d.engine.totals["rejected"] == 0
    assert d.engine.participation.get("a").rejected == 0  # type: ignore[union-attr]


def test_async_task_with_only_refused_updates_is_rejected_when_it_expires() -> None:
    """b's update claims more than b announced and c's holds NaN; both tasks stay open until their
    deadline, then end rejected (not expired), once each, and their slots are refilled."""
    d = _driver(concurrency=3)
    _, b, cc = _configure(d, d.start("a", "b", "c", "d", "e"))
    assert one(c.Refused, d.feed(update(b, samples=SAMPLES + 1))).reason == "samples-mismatch"
    assert one(c.Refused, d.feed(update(cc, value=float("nan")))).reason == "non-finite"
    assert one(c.Refused, d.feed(update(cc, value=float("nan")))).reason == "non-finite"
    out = d.tick(20.0)
    assert len(one(c.Configure, out).tasks) == 3
    assert isinstance(d.engine, BufferedAsync)
    assert d.engine.totals == {"rejected": 2, "expired": 1} and d.engine.refused["non-finite"] == 2
    assert d.engine.participation.get(b.node).rejected == 1 and d.engine.participation.get(b.node).late == 0  # type: ignore[union-attr]
    late = d.feed(update(cc), at=21.0)
    assert one(c.Refused, late).reason == "expired"


def test_async_node_with_no_announced_count_is_refused() -> None:
    d = _driver()
    (a, *_) = _configure(d, d.start("a", "b", "c", samples=None))
    assert one(c.Refused, d.feed(update(a))).reason == "samples-unannounced"


def test_async_a_fold_holding_nan_is_not_published_and_the_engine_goes_on() -> None:
    """Issue 31, item 2, in async mode: the half reports its fold held NaN or inf (it fell back to the
    last good model already): the version does not move, the line names the folded updates as
    suspects, and the next K updates fold into the version that was missed."""
    d = _driver(buffer=1, concurrency=2)
    first, second = _configure(d, d.start("a", "b"))
    out = d.feed(update(first))
    aggregate = one(c.Aggregate, out)
    _configure(d, out)
    out = d.feed(e.Aggregated(aggregate.step, {}, "sha", rejected="non-finite (w)"))
    record = one(c.Record, out).record
    assert record["aggregated"] is False and record["model_rejected"] == "the folded model holds non-finite (w)"
    assert record["suspects"] == [first.node] and record["model_version"] == 0 and record["version"] == 0
    assert d.engine.version == 0 and not of(c.Evaluate, out)  # type: ignore[union-attr]
    retry = one(c.Aggregate, d.feed(update(second)))
    assert retry.ctx.version == 0
    out = d.feed(e.Aggregated(retry.step, {}))
    assert one(c.Record, out).record["model_version"] == 1 and d.engine.folds_without_model == 0  # type: ignore[union-attr]


def test_async_folds_that_keep_failing_end_the_run_with_the_reason() -> None:
    """policy.max_rounds_without_model counts folds in async mode: two rejected folds in a row with a
    bound of 2 fail the run, saying why, instead of folding poison for ever."""
    d = _driver(buffer=1, concurrency=2, policy={"max_rounds_without_model": 2})
    tasks = _configure(d, d.start("a", "b"))
    out: list[c.Command] = []
    for task in tasks:
        aggregate = one(c.Aggregate, d.feed(update(task)))
        out = d.feed(e.Aggregated(aggregate.step, {}, "sha", rejected="non-finite (w)"))
        _configure(d, out)
    finish = one(c.Finish, out)
    assert finish.state == "failed" and "2 folds in a row made no new model" in d.engine.error  # type: ignore[union-attr]
