"""The algorithm half's heavy calls as the engine's commands ask for them: one definition for the
daemon (which runs them on its worker thread) and the in-process driver (which runs them inline),
so that both call the half the same way."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedmq.coordinator.compressed import check_one_model, restore
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.versions import ModelVersions
from fedmq.fedcore.algorithms.base import CoordinatorHalf, Payload
from fedmq.fedcore.tensors import model_sha256

Records = Mapping[str, Sequence[Mapping[str, Any]]]
"""The half's `round_records`, by log name."""


class HalfCalls:
    def __init__(self, half: CoordinatorHalf, config: CoordinatorConfig) -> None:
        self.half = half
        self.versions = ModelVersions()
        self._deltas = config.compression.enabled and config.compression.delta
        """Delta-compressed updates are differences from their task's model: keep those models."""
        self._keep_versions = self._deltas or (config.engine == "async" and config.asynchronous.rule == "fedbuff")
        """FedBuff folds each update as a delta from the model its node received: keep those models."""
        self._sync_kept = config.asynchronous.max_staleness if config.policy.late_updates == "carry" else 0
        """Sync rounds: versions an update may lag and still be folded (a late one carried)."""

    def configure(self, command: c.Configure) -> Payload | Mapping[str, Payload]:
        payload = self.half.configure_round(command.ctx)
        if self._deltas and not isinstance(payload, Payload):
            check_one_model(payload)
        if self._keep_versions:
            self.versions.keep(command.ctx.version, payload, self.half)
        return payload

    def aggregate(self, command: c.Aggregate) -> tuple[e.Aggregated, Records]:
        """The new model, and the metrics the round logs (the averaging rule's, then the half's)."""
        updates = restore(command.updates, self.versions.model) if self._deltas else command.updates
        metrics = self.half.aggregate(self.versions.context(command), updates, command.failures)
        metrics = {**self.half.averaging_metrics(), **metrics}
        records = self.half.round_records()
        keep_from = command.keep_from
        if keep_from is None and self._deltas:  # sync rounds: no later update can come from older versions
            keep_from = command.ctx.version + 1 - self._sync_kept
        self.versions.prune(keep_from)
        return e.Aggregated(command.step, metrics, model_sha256(self.half.model)), records
