"""The models that tasks were built from, kept while an update may still be folded against one of
them (FedBuff adds each update's delta from the model its node received) or still needs one to be
read (a delta-compressed update is a difference from its task's model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from fedmq.coordinator.engine.commands import Aggregate
from fedmq.coordinator.errors import CoordinatorError
from fedmq.fedcore.algorithms.base import CoordinatorHalf, Payload, RoundContext
from fedmq.fedcore.tensors import StateDict, cpu_copy


class ModelVersions:
    """Version -> a copy of the 'model' group its tasks carried. Filled when a version's first task
    is configured with `Configure.keep_model`, read by the `Aggregate` that folds its updates, pruned
    by `Aggregate.keep_from`: the engine decides all three."""

    def __init__(self) -> None:
        self._models: dict[int, StateDict] = {}

    def __len__(self) -> int:
        return len(self._models)

    def keep(self, version: int, payload: Payload | Mapping[str, Payload], half: CoordinatorHalf) -> None:
        """Call right after `configure_round` for `version` (the half's model is that version then)."""
        if version in self._models:
            return
        first = payload if isinstance(payload, Payload) else next(iter(payload.values()), None)
        group = first.tensors.get("model") if first is not None else None
        self._models[version] = cpu_copy(group if group is not None else half.model.state_dict())

    def model(self, version: int) -> StateDict:
        """The kept model of `version` (CoordinatorError when it was not kept or is pruned)."""
        model = self._models.get(version)
        if model is None:
            raise CoordinatorError(f"the model of version {version} was not kept")
        return model

    def context(self, command: Aggregate) -> RoundContext:
        """The command's context with the base models its updates trained from."""
        if not command.bases:
            return command.ctx
        missing = [v for v in command.bases if v not in self._models]
        if missing:
            raise CoordinatorError(f"the models of versions {missing} were not kept")
        bases = {v: self._models[v] for v in command.bases}
        return replace(command.ctx, folding=replace(command.ctx.folding, bases=bases))

    def prune(self, keep_from: int | None) -> None:
        if keep_from is None:
            return
        for version in [v for v in self._models if v < keep_from]:
            del self._models[version]
