"""The coordinator as a pure engine: events in, commands out, time passed in (`clock`).

`SyncRounds` runs synchronous rounds; `BufferedAsync` keeps `concurrency` nodes busy and folds every
K updates into a new model version (FedAsync with K = 1, FedBuff above). The MQTT daemon
(`coordinator.drivers.mqtt`) and the in-process driver execute their commands.
"""

from __future__ import annotations

from typing import Any

from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine.base import Engine, Schema
from fedmq.coordinator.engine.buffered import BufferedAsync
from fedmq.coordinator.engine.sync import SyncRounds


def make_engine(config: CoordinatorConfig, schema: Schema, **kwargs: Any) -> Engine:
    """The engine `config.engine` names."""
    kind = BufferedAsync if config.engine == "async" else SyncRounds
    return kind(config, schema, **kwargs)


__all__ = ["BufferedAsync", "Engine", "SyncRounds", "make_engine"]
