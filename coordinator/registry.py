"""Which nodes exist and which are live, from the retained status topic and node announcements."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedmq.fedcore.protocol import Announcement

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeInfo:
    node_id: str
    online: bool = False
    device: str = "unknown"
    num_samples: int | None = None
    """What the node announced it holds (None: it never announced a count)."""
    label_histogram: list[int] | None = None
    first_seen: float = field(default_factory=time.time)
    changed_at: float = field(default_factory=time.monotonic)


class NodeRegistry:
    """Which nodes exist, what they announced, and which are live (the engine is told of changes)."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeInfo] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def get(self, node_id: str) -> NodeInfo | None:
        return self._nodes.get(node_id)

    def live_ids(self) -> list[str]:
        return sorted(n.node_id for n in self._nodes.values() if n.online)

    def is_live(self, node_id: str) -> bool:
        node = self._nodes.get(node_id)
        return node is not None and node.online

    def all(self) -> list[NodeInfo]:
        return [self._nodes[k] for k in sorted(self._nodes)]

    def apply_status(self, node_id: str, status: Announcement | Mapping[str, Any]) -> bool | None:
        """Record a node's announcement (or a status message's meta, ProtocolError if it is malformed);
        returns the new liveness if it changed, else None. A field the status leaves out keeps its
        earlier value (a count, once announced, stays known)."""
        announcement = status if isinstance(status, Announcement) else Announcement.from_meta(status)
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeInfo(node_id)
        was = node.online
        node.online = announcement.online
        if announcement.num_samples is not None:
            node.num_samples = announcement.num_samples
        if announcement.device is not None:
            node.device = announcement.device
        if announcement.label_histogram is not None:
            node.label_histogram = list(announcement.label_histogram)
        node.changed_at = time.monotonic()
        if was != node.online:
            logger.info(
                "node %s is %s (%d live)", node_id, "online" if node.online else "offline", len(self.live_ids())
            )
            return node.online
        return None
