"""CoordinatorMetrics: what it counts from the engine's commands and reads at scrape time, value for
value, parsed back from its Prometheus text as a scraper would."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CONTENT_TYPE_LATEST

from fedmq.broker import BusConfig, Kind, Message
from fedmq.broker.client import BusStats
from fedmq.coordinator.drivers.mqtt import Coordinator
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.buffered import BufferedAsync
from fedmq.coordinator.observers.metrics import CoordinatorMetrics
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from tests.coordinator.engine_helpers import Driver, config, of, one, seen, update
from tests.coordinator.test_payloads import PerNode, _model
from tests.helpers import Samples, parse_metrics, value


def scrape(metrics: CoordinatorMetrics) -> Samples:
    """Every sample of `render()`, by name and sorted labels, parsed by prometheus_client's own parser."""
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE_LATEST
    return parse_metrics(body)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


class Watched(Driver):
    """A Driver whose every event and commands also go to a CoordinatorMetrics, as the daemon's watchers."""

    def __init__(self, *args: Any, bus: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metrics = CoordinatorMetrics(engine=self.engine, bus=(lambda: bus) if bus is not None else None)

    def feed(self, event: e.Event, *, at: float | None = None) -> list[c.Command]:
        out = super().feed(event, at=at)
        self.metrics(self.clock.now(), event, out)
        return out


def _message(sender: str) -> Message:
    return Message(kind=Kind.UPDATE, federation="f", round=0, sender=sender, meta={})


def test_metrics_sync_lines_count_rounds_outcomes_round_time_and_model_figures_exactly() -> None:
    """Three sync metrics lines (an aggregated round, an insufficient attempt, its aggregated retry)
    give exactly their sums: outcomes by list length, the round-time buckets, the latest accuracy,
    loss and train_loss, the best accuracy and the model version."""
    metrics = CoordinatorMetrics()
    records: list[dict[str, Any]] = [
        {"round": 0, "attempt": 0, "selected": list("abcdef"), "accepted": list("abc"), "carried": [],
         "late": ["d"], "lost": ["e"], "rejected": [], "failed": ["f"], "live": 6, "aggregated": True,
         "train_loss": 0.9, "accuracy": 0.5, "loss": 1.2, "round_seconds": 0.7, "ended_s": 0.7, "model_version": 1},
        {"round": 1, "attempt": 0, "selected": ["a", "b"], "accepted": ["a"], "carried": [], "late": [],
         "lost": ["b"], "rejected": [], "failed": [], "live": 5, "aggregated": False, "round_seconds": 3.0,
         "ended_s": 3.7, "model_version": 1},
        {"round": 1, "attempt": 1, "selected": ["c", "d"], "accepted": ["c", "d"], "carried": ["a"], "late": [],
         "lost": [], "rejected": ["g"], "failed": [], "late_folded": ["x"], "superseded": [], "live": 5,
         "aggregated": True, "accuracy": 0.4, "loss": 1.5, "round_seconds": 12.0, "ended_s": 15.7,
         "model_version": 2},
    ]  # fmt: skip
    for record in records:
        metrics(0.0, e.Tick(), [c.Record(record)])
    s = scrape(metrics)
    assert value(s, "fedmq_rounds_completed_total") == 2
    assert value(s, "fedmq_round_attempts_insufficient_total") == 1
    outcomes = {"accepted": 6, "late": 1, "lost": 2, "rejected": 1, "failed": 1, "late_folded": 1}
    for outcome, count in outcomes.items():
        assert value(s, "fedmq_updates_total", outcome=outcome) == count, outcome
    assert not any(name == "fedmq_updates_total" and dict(labels)["outcome"] == "carried" for name, labels in s)
    assert value(s, "fedmq_round_seconds_count") == 3
    assert value(s, "fedmq_round_seconds_sum") == pytest.approx(15.7)
    buckets = {"0.5": 0, "1.0": 1, "2.5": 1, "5.0": 2, "10.0": 2, "30.0": 3, "+Inf": 3}
    for le, count in buckets.items():
        assert value(s, "fedmq_round_seconds_bucket", le=le) == count, le
    assert value(s, "fedmq_accuracy") == 0.4 and value(s, "fedmq_best_accuracy") == 0.5
    assert value(s, "fedmq_loss") == 1.5 and value(s, "fedmq_train_loss") == 0.9
    assert value(s, "fedmq_model_version") == 2
    assert not names(s) & {"fedmq_live_nodes", "fedmq_state", "fedmq_bus_received_bytes_total"}, "no engine, no bus"
    assert "fedmq_dp_epsilon" not in names(s)  # no privacy: no gauge
    metrics(0.0, e.Tick(), [c.Record({**records[0], "dp_epsilon": 2.5, "dp_delta": 1e-5})])
    assert value(scrape(metrics), "fedmq_dp_epsilon") == 2.5


def test_metrics_async_commands_count_staleness_receipts_declines_tasks_and_received_updates() -> None:
    """An Aggregate's staleness goes into the histogram bucket by bucket; receipts by status; only
    policy's declines (protocol=False) by reason; SendTask and UpdateArrived counted; an async line's
    counts (stale, expired, ...) and its folded list under outcome=accepted."""
    metrics = CoordinatorMetrics()
    updates = [
        NodeUpdate(node_id=node, round=0, num_samples=10, payload=Payload(), staleness=staleness)
        for node, staleness in zip("abcde", (0, 1, 1, 3, 12), strict=True)
    ]
    aggregate = c.Aggregate(1, None, updates, [])  # type: ignore[arg-type]
    record = {"round": 0, "version": 1, "folded": list("abcde"), "stale": 2, "expired": 1, "lost": 0,
              "rejected": 1, "failed": 0, "aggregated": True, "flush": False, "round_seconds": 0.2,
              "staleness_mean": 3.4, "staleness_max": 12, "model_version": 1}  # fmt: skip
    for node in "abc":
        metrics(0.0, e.UpdateArrived(_message(node), 0.0), [])
    metrics(1.0, e.Tick(), [c.SendTask(1, n) for n in "abcd"])
    metrics(2.0, e.Tick(), [aggregate, c.Record(record)])
    receipts = [("received", 2), ("stale", 1), ("late", 1)]
    metrics(3.0, e.Tick(), [c.Receipt("a", 0, None, b"", status) for status, n in receipts for _ in range(n)])
    declines = [c.Refused("a", "stale", ""), c.Refused("b", "stale", ""), c.Refused("c", "expired", "")]
    declines = [dataclasses.replace(r, protocol=False) for r in declines]
    metrics(4.0, e.Tick(), [*declines, c.Refused("d", "bad-tensor", "forged")])
    s = scrape(metrics)
    assert value(s, "fedmq_update_staleness_count") == 5 and value(s, "fedmq_update_staleness_sum") == 17
    buckets = {"0.0": 1, "1.0": 3, "2.0": 3, "3.0": 4, "10.0": 4, "15.0": 5, "+Inf": 5}
    for le, count in buckets.items():
        assert value(s, "fedmq_update_staleness_bucket", le=le) == count, le
    assert value(s, "fedmq_updates_received_total") == 3 and value(s, "fedmq_tasks_sent_total") == 4
    assert {status: value(s, "fedmq_receipts_total", status=status) for status, _ in receipts} == dict(receipts)
    assert value(s, "fedmq_receipts_total", status="rejected") == 0
    declined = {labels: v for (name, labels), v in s.items() if name == "fedmq_updates_declined_total"}
    assert declined == {(("reason", "stale"),): 2, (("reason", "expired"),): 1}, "a protocol refusal was declined"
    outcomes = {"accepted": 5, "stale": 2, "expired": 1, "rejected": 1, "lost": 0, "failed": 0}
    for outcome, count in outcomes.items():
        assert value(s, "fedmq_updates_total", outcome=outcome) == count, outcome


def test_metrics_on_a_sync_engine_read_live_and_selected_nodes_and_state_at_scrape_time() -> None:
    """A real round: three nodes selected, b goes offline (lost), a and c answer; the counters equal
    the round's metrics line, and the live nodes, the selection and the state are the engine's now."""
    d = Watched(config(policy={"min_nodes": 3}))
    s = scrape(d.metrics)
    assert value(s, "fedmq_live_nodes") == 0 and value(s, "fedmq_state", state="starting") == 1
    configure = one(c.Configure, d.start("a", "b", "c"))
    d.feed(e.Configured(configure.step, inline=True))
    s = scrape(d.metrics)
    assert value(s, "fedmq_live_nodes") == 3 and value(s, "fedmq_selected_nodes") == 3
    assert value(s, "fedmq_state", state="running") == 1 and value(s, "fedmq_state", state="waiting") == 0
    assert value(s, "fedmq_rounds_planned") == 3 and value(s, "fedmq_tasks_sent_total") == 3
    tasks = {t.node: t for t in configure.tasks}
    d.feed(update(tasks["a"]), at=1.0)
    d.feed(seen("b", online=False), at=1.5)
    aggregate = one(c.Aggregate, d.feed(update(tasks["c"]), at=2.0))
    evaluate = one(c.Evaluate, d.feed(e.Aggregated(aggregate.step, {"train_loss": 0.5}), at=2.5))
    out = d.feed(e.Evaluated(evaluate.step, {"accuracy": 0.75, "loss": 1.25}), at=3.0)
    record = one(c.Record, out).record
    assert (record["accepted"], record["lost"], record["round_seconds"]) == (["a", "c"], ["b"], 3.0)
    s = scrape(d.metrics)
    assert value(s, "fedmq_updates_total", outcome="accepted") == 2
    assert value(s, "fedmq_updates_total", outcome="lost") == 1 and value(s, "fedmq_updates_total", outcome="late") == 0
    assert value(s, "fedmq_updates_received_total") == 2 and value(s, "fedmq_receipts_total", status="received") == 2
    assert value(s, "fedmq_update_staleness_count") == 2 and value(s, "fedmq_update_staleness_sum") == 0
    assert value(s, "fedmq_round_seconds_sum") == 3.0 and value(s, "fedmq_rounds_completed_total") == 1
    assert (value(s, "fedmq_accuracy"), value(s, "fedmq_loss"), value(s, "fedmq_train_loss")) == (0.75, 1.25, 0.5)
    assert value(s, "fedmq_live_nodes") == 2
    assert value(s, "fedmq_selected_nodes") == 3, "round 1 is not configured yet: round 0's selection"
    d.feed(e.Configured(one(c.Configure, out).step, inline=True))
    s = scrape(d.metrics)
    assert value(s, "fedmq_selected_nodes") == 2 and value(s, "fedmq_tasks_sent_total") == 5


def test_metrics_on_an_async_engine_count_versions_and_read_the_tasks_in_flight() -> None:
    """K = 2, three slots: two deliveries fold version 1 (staleness 0 each); the async outcomes show
    from the start; selected nodes are the tasks in flight."""
    d = Watched(config(engine="async", buffer=2, concurrency=3, max_staleness=5, aggregations=10), evaluates=False)
    assert isinstance(d.engine, BufferedAsync)
    s = scrape(d.metrics)
    for outcome in ("accepted", "stale", "expired", "lost", "rejected", "failed"):
        assert value(s, "fedmq_updates_total", outcome=outcome) == 0, outcome
    assert ("fedmq_updates_total", (("outcome", "late"),)) not in s
    first = one(c.Configure, d.start(*"abcde"))
    d.feed(e.Configured(first.step, inline=True))
    assert value(scrape(d.metrics), "fedmq_selected_nodes") == 3
    out = d.feed(update(first.tasks[0]), at=1.0)
    assert value(scrape(d.metrics), "fedmq_selected_nodes") == 2, "the refill is not sent yet"
    d.feed(e.Configured(one(c.Configure, out).step, inline=True))
    aggregate = one(c.Aggregate, d.feed(update(first.tasks[1]), at=2.0))
    out = d.feed(e.Aggregated(aggregate.step, {"train_loss": 0.25}), at=2.5)
    record = one(c.Record, out).record
    assert record["folded"] == sorted(t.node for t in first.tasks[:2]) and record["round_seconds"] == 2.5
    s = scrape(d.metrics)
    assert value(s, "fedmq_rounds_completed_total") == 1 and value(s, "fedmq_model_version") == 1
    assert value(s, "fedmq_updates_total", outcome="accepted") == 2
    assert value(s, "fedmq_update_staleness_bucket", le="0.0") == 2 and value(s, "fedmq_update_staleness_count") == 2
    assert value(s, "fedmq_selected_nodes") == len(d.engine.tasks) == 2
    assert value(s, "fedmq_live_nodes") == 5 and value(s, "fedmq_rounds_planned") == 10
    assert value(s, "fedmq_train_loss") == 0.25 and "fedmq_accuracy" not in names(s)
    assert value(s, "fedmq_tasks_sent_total") == len(of(c.SendTask, d.log)) == 4


def test_metrics_read_the_bus_counters_and_rejections_by_reason_when_scraped() -> None:
    """The bus's counters and its rejections by reason as they are at each scrape; no bus yet: zeros,
    not connected."""
    stats = BusStats(received=7, published=5, bytes_in=1000, bytes_out=2500, duplicates=1, reconnects=2)
    stats.rejected.update({"bad-frame": 2, "wrong-round": 1})
    bus: SimpleNamespace | None = SimpleNamespace(stats=stats, connected=True)
    metrics = CoordinatorMetrics(bus=lambda: bus)
    s = scrape(metrics)
    expected = {"fedmq_bus_received_messages_total": 7, "fedmq_bus_published_messages_total": 5,
                "fedmq_bus_received_bytes_total": 1000, "fedmq_bus_sent_bytes_total": 2500,
                "fedmq_bus_duplicate_messages_total": 1, "fedmq_bus_reconnects_total": 2, "fedmq_bus_connected": 1}  # fmt: skip
    assert {name: value(s, name) for name in expected} == expected
    rejected = {dict(labels)["reason"]: v for (name, labels), v in s.items() if name == "fedmq_rejected_messages_total"}
    assert rejected == {"bad-frame": 2, "wrong-round": 1}
    stats.rejected["bad-frame"] += 3
    stats.bytes_in += 24
    s = scrape(metrics)
    assert value(s, "fedmq_rejected_messages_total", reason="bad-frame") == 5
    assert value(s, "fedmq_bus_received_bytes_total") == 1024
    bus = None
    s = scrape(metrics)
    assert value(s, "fedmq_bus_received_bytes_total") == 0 and value(s, "fedmq_bus_connected") == 0
    assert not any(name == "fedmq_rejected_messages_total" for name, _ in s)


def test_metrics_attach_to_a_coordinator_watch_it_and_coexist_with_another(tmp_path: Path) -> None:
    """attach() adds the watcher, labels the info metric, reads the daemon's state and its (not yet
    connected) bus; two instances in one process keep separate registries and counts."""
    cfg = dataclasses.replace(config(), out_dir=tmp_path)
    coordinator = Coordinator(cfg, BusConfig.from_url("mqtt://127.0.0.1:1"), PerNode(None, model=_model()))
    metrics = CoordinatorMetrics.attach(coordinator)
    other = CoordinatorMetrics.attach(coordinator)
    assert coordinator.watchers[-2:] == [metrics, other] and metrics.registry is not other.registry
    metrics(0.0, e.Tick(), [c.SendTask(1, "a")])
    s = scrape(metrics)
    info = {("federation", "f"), ("engine", "sync"), ("method", cfg.method)}
    assert value(s, "fedmq_coordinator_info", **dict(info)) == 1
    assert value(s, "fedmq_state", state="starting") == 1 and value(s, "fedmq_bus_connected") == 0
    assert value(s, "fedmq_tasks_sent_total") == 1 and value(scrape(other), "fedmq_tasks_sent_total") == 0


def test_metrics_a_state_outside_the_known_ones_is_still_shown() -> None:
    """The state gauge lists the known states at 0 and the current one at 1, whatever it is."""
    d = Driver(config())
    metrics = CoordinatorMetrics(engine=d.engine, state=lambda: "draining")
    s = scrape(metrics)
    states = {dict(labels)["state"]: v for (name, labels), v in s.items() if name == "fedmq_state"}
    known = dict.fromkeys(("starting", "waiting", "running", "finished", "failed", "stopped"), 0)
    assert states == {**known, "draining": 1}
