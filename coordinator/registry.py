"""Which nodes exist and which are live, from the retained status topic and node announcements."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedmq.coordinator.errors import ProtocolError

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


def parse_announcement(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a node's status meta; raises ProtocolError naming the bad field."""
    state = meta.get("state")
    if state not in ("online", "offline"):
        raise ProtocolError("bad-status", f"state {state!r} is not 'online' or 'offline'")
    out: dict[str, Any] = {"online": state == "online"}
    if "num_samples" in meta:
        n = meta["num_samples"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ProtocolError("bad-status", f"num_samples {n!r} is not a non-negative integer")
        out["num_samples"] = n
    if "device" in meta:
        if not isinstance(meta["device"], str) or len(meta["device"]) > 64:
            raise ProtocolError("bad-status", "device must be a short string")
        out["device"] = meta["device"]
    hist = meta.get("label_histogram")
    if hist is not None:
        if (
            not isinstance(hist, list)
            or len(hist) > 100_000
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in hist)
        ):
            raise ProtocolError("bad-status", "label_histogram must be a list of non-negative integers")
        out["label_histogram"] = hist
    return out


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

    def apply_status(self, node_id: str, meta: Mapping[str, Any]) -> bool | None:
        """Record a status message; returns the new liveness if it changed, else None. A field the
        status leaves out keeps its earlier value (a count, once announced, stays known)."""
        fields = parse_announcement(meta)
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = NodeInfo(node_id)
        was = node.online
        for key, value in fields.items():
            setattr(node, key, value)
        node.changed_at = time.monotonic()
        if was != node.online:
            logger.info(
                "node %s is %s (%d live)", node_id, "online" if node.online else "offline", len(self.live_ids())
            )
            return node.online
        return None
