"""RelayRounds (a site aggregator's engine) on a fake clock: rounds only when upstream asks, upstream's
round, attempt and settings passed on, a site's own sample, `RoundEnded` for every request."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.relay import ENDLESS, RelayRounds
from fedmq.coordinator.sampler import cohort_size, sample
from tests.coordinator.engine_helpers import SCHEMA, Driver, config, of, one, update

SETTINGS = {"local_epochs": 3, "batch_size": 8, "lr": 0.25}


def _driver(**policy: object) -> Driver:
    d = Driver(config(rounds=ENDLESS, policy={"on_insufficient": "skip", **policy}), evaluates=False)
    ids = itertools.count()
    d.engine = RelayRounds(d.engine.config, SCHEMA, new_id=lambda: next(ids).to_bytes(16, "big"), stratum="s0")
    return d


def _ask(d: Driver, round: int, attempt: int = 0, *, at: float | None = None) -> list[c.Command]:
    return d.feed(e.RoundRequested(round, attempt, SETTINGS), at=at)


def test_a_round_starts_only_when_upstream_asks_and_carries_its_round_and_settings() -> None:
    """Nodes live and started: nothing until a request; then round 7 attempt 1 with upstream's settings."""
    d = _driver()
    out = d.start("a", "b")
    assert not of(c.Configure, out) and d.engine.state == "running" and d.engine.next_deadline() is None
    configure = one(c.Configure, _ask(d, 7, 1))
    assert configure.ctx.round == 7 and {(t.round, t.attempt) for t in configure.tasks} == {(7, 1)}
    assert configure.settings == SETTINGS
    assert [t.node for t in configure.tasks] == ["a", "b"]


def test_every_request_ends_in_one_round_ended_and_the_site_never_retries() -> None:
    """Round 0 aggregates (RoundEnded aggregated, after the Aggregate); round 1 hears nothing by its
    deadline and ends unaggregated, without a retry, waiting for the next request."""
    d = _driver(min_updates=1)
    d.start("a", "b")
    configure = one(c.Configure, _ask(d, 0))
    d.feed(e.Configured(configure.step, inline=True))
    tasks = {t.node: t for t in configure.tasks}
    d.feed(update(tasks["a"]), at=1)
    aggregate = one(c.Aggregate, d.feed(update(tasks["b"]), at=2))
    out = d.feed(e.Aggregated(aggregate.step, {"site_updates": 2}))
    ended = one(c.RoundEnded, out)
    assert (ended.round, ended.attempt, ended.aggregated, ended.accepted) == (0, 0, True, 2)
    assert not of(c.Evaluate, out) and not of(c.Configure, out)
    assert not of(c.Checkpoint, out)  # a site keeps nothing between rounds (upstream holds the model)
    configure = one(c.Configure, _ask(d, 1, at=3))
    d.feed(e.Configured(configure.step, inline=True))
    out = d.tick(3 + 10.0)
    ended = one(c.RoundEnded, out)
    assert (ended.round, ended.aggregated, ended.accepted) == (1, False, 0)
    assert not of(c.Configure, out) and not of(c.Aggregate, out)


def test_a_site_without_live_nodes_answers_at_once() -> None:
    d = _driver()
    d.start()
    ended = one(c.RoundEnded, _ask(d, 4))
    assert (ended.round, ended.aggregated) == (4, False)
    assert not of(c.Configure, d.log)


def test_a_request_while_a_round_collects_closes_it_with_what_it_has() -> None:
    """Upstream moved on: round 0 closes now with a's update (its partial still goes up), round 1 starts."""
    d = _driver()
    d.start("a", "b")
    configure = one(c.Configure, _ask(d, 0))
    d.feed(e.Configured(configure.step, inline=True))
    d.feed(update(next(t for t in configure.tasks if t.node == "a")))
    aggregate = one(c.Aggregate, _ask(d, 1))
    assert [u.node_id for u in aggregate.updates] == ["a"]
    out = d.feed(e.Aggregated(aggregate.step, {}))
    assert one(c.RoundEnded, out).round == 0 and one(c.Configure, out).ctx.round == 1


def test_upstream_finished_ends_the_site() -> None:
    d = _driver()
    d.start("a")
    finish = one(c.Finish, d.feed(e.UpstreamFinished("finished")))
    assert finish.state == "finished" and d.engine.finished


def test_a_site_samples_its_own_nodes_with_c_times_live_on_average() -> None:
    """A site's cohort is C x live rounded at random (0.25 x 10 = 2.5: 2 or 3, 2.5 on average), from a
    stream of its own: two sites do not pick the same positions every round."""
    live = [f"n{i}" for i in range(10)]
    sizes = Counter(len(sample(live, fraction=0.25, over_selection=1.0, seed=0, round=r, stratum="f.s0").selected)
                    for r in range(2000))  # fmt: skip
    assert set(sizes) == {2, 3} and sum(k * n for k, n in sizes.items()) / 2000 == pytest.approx(2.5, abs=0.05)
    same = sum(
        sample(live, fraction=0.2, over_selection=1.0, seed=0, round=r, stratum="f.s0").selected
        == sample(live, fraction=0.2, over_selection=1.0, seed=0, round=r, stratum="f.s1").selected
        for r in range(50)
    )
    assert same < 10
    # a flat cohort is unchanged: floor(C x live), the stream it always drew from
    assert cohort_size(10, 0.25) == 2 and cohort_size(10, 0.25, draw=0.49) == 3 and cohort_size(10, 0.25, draw=0.5) == 2
    d = _driver(fraction=0.25)
    d.start(*live)
    configure = one(c.Configure, _ask(d, 0))
    expected = sample(live, fraction=0.25, over_selection=1.0, seed=0, round=0, stratum="s0")
    assert tuple(t.node for t in configure.tasks) == expected.selected


def test_a_late_update_after_the_site_round_closed_is_refused_as_late() -> None:
    d = _driver()
    d.start("a", "b")
    configure = one(c.Configure, _ask(d, 0))
    d.feed(e.Configured(configure.step, inline=True))
    tasks = {t.node: t for t in configure.tasks}
    d.feed(update(tasks["a"]))
    d.tick(10.0)  # b is late
    receipt = one(c.Receipt, d.feed(update(tasks["b"]), at=11))
    assert receipt.status == "late" and receipt.node == "b"
