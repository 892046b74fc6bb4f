"""The coordinator's Prometheus metrics (`docs/metrics.md` names and explains every one).

`CoordinatorMetrics` is a watcher (`Coordinator.watchers`): it sees each event with the engine's
commands and counts what the metrics lines say (`c.Record`: one per sync round attempt or async
model version), the staleness of every folded update (`c.Aggregate`), receipts and declined updates.
What describes the present (live and selected nodes, the state, the bus's traffic and rejections) is
read from the coordinator when Prometheus scrapes, so it never drifts from the daemon's own figures.
Each instance has its own registry (never the process-global one), so several coexist in one process.
`render()` is what the HTTP API serves at `/metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from fedmq.broker.client import BusStats
from fedmq.broker.prometheus import bus_families
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.base import Engine
from fedmq.coordinator.engine.buffered import BufferedAsync
from fedmq.coordinator.engine.sync import SyncRounds
from fedmq.fedcore.protocol import RunState

if TYPE_CHECKING:
    from fedmq.coordinator.drivers.mqtt import Coordinator

ROUND_SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 7, 10, 15, 20, 30, 50, 100)
"""Model versions between the one an update trained from and the one it is folded into."""
STATES = tuple(s.value for s in RunState if s is not RunState.OFFLINE)
"""The coordinator's states (offline is only ever its will)."""

OUTCOME_KEYS = {
    "accepted": "accepted",
    "folded": "accepted",  # async: folded into the version
    "late": "late",
    "late_folded": "late_folded",
    "stale": "stale",
    "expired": "expired",
    "lost": "lost",
    "rejected": "rejected",
    "failed": "failed",
}
"""A metrics line's key -> the `outcome` label it counts under (a list counts its length, a number itself)."""
OUTCOMES = {
    "sync": ("accepted", "late", "lost", "rejected", "failed"),
    "async": ("accepted", "stale", "expired", "lost", "rejected", "failed"),
}
"""The outcomes each engine's lines carry, shown from the start at 0."""
RECEIPTS = ("received", "late", "stale", "rejected")
MODEL_GAUGES = {
    "accuracy": "Test accuracy of the global model at its latest evaluation.",
    "loss": "Test loss of the global model at its latest evaluation.",
    "train_loss": "Mean training loss the nodes reported for the latest aggregation, when the method reports it.",
    "dp_epsilon": "Privacy spent so far: central DP's epsilon at its delta (privacy.mechanism central).",
}
PROTOCOL_REJECTIONS = "Messages rejected as breaking the protocol (malformed, forged, out of round, ...), by reason."


class BusView(Protocol):
    """What the metrics read of a bus client: its counters and whether it is connected."""

    @property
    def stats(self) -> BusStats: ...

    @property
    def connected(self) -> bool: ...


class CoordinatorMetrics:
    """Prometheus metrics of one coordinator; call `attach` to watch a running one.

    Built by hand (tests), `engine` gives the live and selected nodes and the state, `bus` the
    traffic; without them those series are left out."""

    def __init__(
        self,
        *,
        engine: Engine | None = None,
        bus: Callable[[], BusView | None] | None = None,
        state: Callable[[], str] | None = None,
        info: Mapping[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self._bus = bus
        self._state = state
        self._info = dict(info or {})
        self.registry = CollectorRegistry(auto_describe=True)
        kind = "async" if isinstance(engine, BufferedAsync) else "sync"
        self.rounds = Counter(
            "fedmq_rounds_completed",
            "Rounds (sync) or model versions (async) aggregated: metrics lines with aggregated true.",
            registry=self.registry,
        )
        self.insufficient = Counter(
            "fedmq_round_attempts_insufficient",
            "Sync round attempts that ended with fewer updates than min_updates (retried or skipped).",
            registry=self.registry,
        )
        self.updates = Counter(
            "fedmq_updates",
            "Updates by outcome, as the metrics lines count them: accepted (sync: taken in the round attempt;"
            " async: folded into a version), late, lost, rejected, failed (sync), late_folded (sync, carried"
            " late updates), stale, expired (async).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in OUTCOMES[kind]:
            self.updates.labels(outcome)
        self.received = Counter(
            "fedmq_updates_received",
            "Update messages that passed the bus's checks and reached the engine (before its own checks).",
            registry=self.registry,
        )
        self.tasks = Counter("fedmq_tasks_sent", "Tasks sent to nodes.", registry=self.registry)
        self.declined = Counter(
            "fedmq_updates_declined",
            "Valid updates that policy did not fold (too stale, expired, after the end), by reason;"
            " protocol refusals are in fedmq_rejected_messages_total.",
            ["reason"],
            registry=self.registry,
        )
        self.receipts = Counter(
            "fedmq_receipts",
            "Receipts sent to nodes, by status (received ones only with policy.receipts: all).",
            ["status"],
            registry=self.registry,
        )
        for status in RECEIPTS:
            self.receipts.labels(status)
        self.round_seconds = Histogram(
            "fedmq_round_seconds",
            "Wall seconds of each sync round attempt or async model version (round_seconds of the metrics lines).",
            buckets=ROUND_SECONDS_BUCKETS,
            registry=self.registry,
        )
        self.staleness = Histogram(
            "fedmq_update_staleness",
            "Staleness of each update folded into the global model, in model versions (0 for a fresh sync update).",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self.last: dict[str, float] = {}
        """The latest value of each of MODEL_GAUGES and of the model version, from the metrics lines."""
        self.best_accuracy: float | None = None
        self.registry.register(_Present(self))

    @classmethod
    def attach(cls, coordinator: Coordinator) -> CoordinatorMetrics:
        """Metrics watching `coordinator` from its next event on."""
        config = coordinator.config
        metrics = cls(
            engine=coordinator.engine,
            bus=lambda: coordinator.bus,  # its stats are what summary.json reports as "bus"
            state=lambda: coordinator.state,
            info={"federation": config.federation, "engine": config.engine, "method": config.method},
        )
        coordinator.watchers.append(metrics)
        return metrics

    def __call__(self, now: float, event: e.Event, commands: list[c.Command]) -> None:
        if isinstance(event, e.UpdateArrived):
            self.received.inc()
        for command in commands:
            if isinstance(command, c.Record):
                self._record(command.record)
            elif isinstance(command, c.Aggregate):
                for update in command.updates:
                    self.staleness.observe(update.staleness)
            elif isinstance(command, c.SendTask):
                self.tasks.inc()
            elif isinstance(command, c.Receipt):
                self.receipts.labels(command.status).inc()
            elif isinstance(command, c.Refused) and not command.protocol:
                self.declined.labels(command.reason).inc()

    def _record(self, record: Mapping[str, Any]) -> None:
        (self.rounds if record.get("aggregated") else self.insufficient).inc()
        for key, outcome in OUTCOME_KEYS.items():
            value = record.get(key)
            count = len(value) if isinstance(value, list) else value if isinstance(value, int) else 0
            if count:
                self.updates.labels(outcome).inc(count)
        if isinstance(record.get("round_seconds"), int | float):
            self.round_seconds.observe(record["round_seconds"])
        for key in (*MODEL_GAUGES, "model_version"):
            if isinstance(record.get(key), int | float):
                self.last[key] = float(record[key])
        if "accuracy" in record:
            accuracy = float(record["accuracy"])
            self.best_accuracy = accuracy if self.best_accuracy is None else max(self.best_accuracy, accuracy)

    def render(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Present:
    """The gauges and bus counters read when Prometheus scrapes."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        if m._info:
            yield InfoMetricFamily("fedmq_coordinator", "The coordinator's federation, engine and method.", m._info)
        for key, doc in MODEL_GAUGES.items():
            if key in m.last:
                yield GaugeMetricFamily(f"fedmq_{key}", doc, value=m.last[key])
        if m.best_accuracy is not None:
            yield GaugeMetricFamily("fedmq_best_accuracy", "Best test accuracy so far.", value=m.best_accuracy)
        if "model_version" in m.last:
            yield GaugeMetricFamily(
                "fedmq_model_version",
                "The global model's version (aggregations so far).",
                value=m.last["model_version"],
            )
        if m.engine is not None:
            yield from _engine_families(m.engine, m._state() if m._state is not None else m.engine.state)
        bus = m._bus() if m._bus is not None else None
        if m._bus is not None:
            yield from bus_families([bus.stats] if bus is not None else [], PROTOCOL_REJECTIONS)
            yield GaugeMetricFamily(
                "fedmq_bus_connected", "1 while connected to the broker.", value=int(bus is not None and bus.connected)
            )


def _engine_families(engine: Engine, state: str) -> Iterator[Metric]:
    yield GaugeMetricFamily("fedmq_live_nodes", "Nodes online now (their retained status).", value=len(engine.live))
    if isinstance(engine, SyncRounds):
        selected = len(engine.current.selected) if engine.current is not None else 0
    elif isinstance(engine, BufferedAsync):
        selected = len(engine.tasks)
    else:
        selected = 0
    yield GaugeMetricFamily(
        "fedmq_selected_nodes",
        "Nodes holding a task now: sync, the selection of the latest round attempt; async, the tasks in flight.",
        value=selected,
    )
    rounds = engine.status_fields().get("rounds")
    if isinstance(rounds, int):
        yield GaugeMetricFamily(
            "fedmq_rounds_planned", "Rounds (sync) or model versions (async) the run is to make.", value=rounds
        )
    family = GaugeMetricFamily(
        "fedmq_state", "1 for the coordinator's current state, 0 for the others.", labels=["state"]
    )
    for name in (*STATES, *([state] if state not in STATES else [])):
        family.add_metric([name], int(name == state))
    yield family
