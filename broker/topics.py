"""The topic scheme, namespaced by federation id (docs/protocol.md has the table).

fedmq/{fed}/coordinator/status   retained   coordinator -> watchers  every round: round, model version, state
fedmq/{fed}/coordinator/state    retained   coordinator -> nodes     the same, only when the state changes
fedmq/{fed}/nodes/{node}/status  retained   node -> coordinator    online + announcement / offline (will)
fedmq/{fed}/nodes/{node}/task               coordinator -> node    the task of a round
fedmq/{fed}/nodes/{node}/model              coordinator -> node    a model re-sent to one late subscriber
fedmq/{fed}/nodes/{node}/receipt            coordinator -> node    what became of the node's update
fedmq/{fed}/model/{round}                   coordinator -> selected nodes (one publish, broker fan-out)
fedmq/{fed}/acks/{node}                     node -> coordinator    task acknowledged, model topic subscribed
fedmq/{fed}/updates/{node}                  node -> coordinator    the update
fedmq/{fed}/secagg/{node}                   node -> coordinator    secure aggregation: keys, shares, reveals
fedmq/{fed}/nodes/{node}/secagg             coordinator -> node    secure aggregation: directory, shares, unmask
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROOT = "fedmq"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def check_id(value: str, what: str) -> str:
    """Ids become topic levels, so they may not contain '/', '+', '#' or spaces."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not valid: use 1 to 64 letters, digits, '_', '.' or '-', starting with a"
            " letter or digit"
        )
    return value


@dataclass(frozen=True, slots=True)
class Route:
    """What a topic addresses: its channel, and the node or round it names."""

    channel: str
    node: str | None = None
    round: int | None = None


@dataclass(frozen=True, slots=True)
class Topics:
    federation: str

    def __post_init__(self) -> None:
        check_id(self.federation, "federation id")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.federation}"

    @property
    def coordinator_status(self) -> str:
        return f"{self.prefix}/coordinator/status"

    @property
    def coordinator_state(self) -> str:
        """Published on state changes only: what nodes follow, so that a round's status is not fanned
        out to every connected node (1000 messages a round at 1000 nodes)."""
        return f"{self.prefix}/coordinator/state"

    def node_status(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/status"

    @property
    def all_node_status(self) -> str:
        return f"{self.prefix}/nodes/+/status"

    def task(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/task"

    def direct_model(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/model"

    def receipt(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/receipt"

    def node_secagg(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/secagg"

    def node_inbox(self, node: str) -> list[str]:
        """What a node subscribes to for messages addressed to it alone."""
        return [self.task(node), self.direct_model(node), self.receipt(node), self.node_secagg(node)]

    def model(self, round: int) -> str:
        return f"{self.prefix}/model/{round}"

    def ack(self, node: str) -> str:
        return f"{self.prefix}/acks/{node}"

    @property
    def all_acks(self) -> str:
        return f"{self.prefix}/acks/+"

    def update(self, node: str) -> str:
        return f"{self.prefix}/updates/{node}"

    @property
    def all_updates(self) -> str:
        return f"{self.prefix}/updates/+"

    def secagg(self, node: str) -> str:
        return f"{self.prefix}/secagg/{node}"

    @property
    def all_secagg(self) -> str:
        return f"{self.prefix}/secagg/+"

    def route(self, topic: str) -> Route | None:
        """Parse a topic of this federation; None for anything outside the scheme, a node id that is
        not a valid id (`check_id`) included: daemons build topics from the node a topic names (its
        receipt, its task), and a 65,000-character id made a receipt topic over MQTT's 65,535-byte
        limit, which paho raised in the coordinator's driver (issue 31)."""
        parts = topic.split("/")
        if len(parts) < 3 or parts[0] != ROOT or parts[1] != self.federation:
            return None
        rest = parts[2:]
        if rest == ["coordinator", "status"]:
            return Route("coordinator-status")
        if rest == ["coordinator", "state"]:
            return Route("coordinator-state")
        if len(rest) == 3 and rest[0] == "nodes" and rest[2] in ("status", "task", "model", "receipt", "secagg"):
            return Route(f"node-{rest[2]}", node=rest[1]) if _ID.fullmatch(rest[1]) else None
        if len(rest) == 2 and rest[0] in ("acks", "updates", "secagg"):
            return Route(rest[0], node=rest[1]) if _ID.fullmatch(rest[1]) else None
        if len(rest) == 2 and rest[0] == "model" and rest[1].isdigit():
            return Route("model", round=int(rest[1]))
        return None
