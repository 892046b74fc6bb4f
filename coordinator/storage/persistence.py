"""Checkpoint and resume: the half's model and state with the engine's meta, keyed by round or version.

A checkpoint is a snapshot taken between the half's heavy calls (copies, so the run goes on while
`CheckpointWriter` puts it on disk) plus the engine's `checkpoint_meta`; resuming loads the tensors
back into the half and hands the meta to the engine's `restore`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from fedmq.coordinator.errors import CoordinatorError
from fedmq.coordinator.storage.checkpoints import CheckpointWriter
from fedmq.coordinator.storage.run_dir import RunDir
from fedmq.fedcore.algorithms.base import CoordinatorHalf, half_state, load_half_state

logger = logging.getLogger(__name__)


class Persistence:
    def __init__(self, run_dir: RunDir, half: CoordinatorHalf) -> None:
        self.run_dir = run_dir
        self.half = half
        self.writer = CheckpointWriter()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the model and the half's extra state (runs in the half's worker lane)."""
        tensors = {f"model/{k}": v for k, v in self.half.model.state_dict().items()}
        tensors |= {f"extra/{k}": v for k, v in half_state(self.half).items()}
        return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}

    def submit(self, key: int, tensors: dict[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        meta = dict(meta)
        self.writer.submit(key, lambda: self._persist(tensors, meta))

    def _persist(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.run_dir.save_checkpoint(tensors, meta)
        self.run_dir.write_json("participation.json", meta["participation"])

    async def flush(self) -> None:
        await self.writer.flush()

    def resume(self, *, federation: str, seed: int, engine: str) -> dict[str, Any] | None:
        """Load the last checkpoint into the half; its meta for the engine, or None to start afresh."""
        loaded = self.run_dir.load_checkpoint()
        if loaded is None:
            logger.info("no checkpoint in %s; starting from the beginning", self.run_dir.root)
            return None
        tensors, meta = loaded
        if meta.get("federation") != federation or meta.get("seed") != seed:
            raise CoordinatorError("the checkpoint belongs to another federation or seed; use another --out")
        if meta.get("engine", "sync") != engine:
            raise CoordinatorError(
                f"the checkpoint was made by the {meta.get('engine', 'sync')} engine, this run is {engine}:"
                " use another --out"
            )
        model = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
        extra = {k.removeprefix("extra/"): v for k, v in tensors.items() if k.startswith("extra/")}
        try:
            self.half.model.load_state_dict(model)
            load_half_state(self.half, extra)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CoordinatorError(f"checkpoint does not match this experiment: {exc}") from exc
        return meta
