"""The bus client's counters as Prometheus metric families, for whichever daemon exports them: the
coordinator's one client, or a node host's many summed. Only prometheus_client's data types: the
bus still knows nothing of who scrapes it or of learning."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from fedmq.broker.client import BusStats

BUS_COUNTERS = (
    ("received", "fedmq_bus_received_messages", "Messages received from the broker (decoded frames)."),
    ("published", "fedmq_bus_published_messages", "Messages published to the broker."),
    ("bytes_in", "fedmq_bus_received_bytes", "Bytes of frames received from the broker."),
    ("bytes_out", "fedmq_bus_sent_bytes", "Bytes of frames published to the broker."),
    ("duplicates", "fedmq_bus_duplicate_messages", "Redelivered messages dropped as duplicates."),
    ("reconnects", "fedmq_bus_reconnects", "Reconnections to the broker."),
)


def bus_families(stats: Iterable[BusStats], rejected_doc: str) -> Iterator[Metric]:
    """The bus counters summed over `stats`, and `fedmq_rejected_messages` by reason (`rejected_doc` says
    what this daemon counts there)."""
    stats = list(stats)
    for attr, name, doc in BUS_COUNTERS:
        yield CounterMetricFamily(name, doc, value=sum(getattr(s, attr) for s in stats))
    rejected = CounterMetricFamily("fedmq_rejected_messages", rejected_doc, labels=["reason"])
    reasons: dict[str, int] = {}
    for s in stats:
        for reason, count in s.rejected.items():
            reasons[reason] = reasons.get(reason, 0) + count
    for reason, count in sorted(reasons.items()):
        rejected.add_metric([reason], count)
    yield rejected
