"""A node's side of secure aggregation for one task: the `secagg-*` steps and its masked update.

Pure and synchronous (no MQTT), and in fedcore because two drivers run it: the node daemon
(`fednode.masking`) and the coordinator's in-process driver (`coordinator.drivers.local`), which
plays the nodes, so that a simulation masks exactly as a node does. The cryptography is
`fedcore.secagg`'s; what is masked, `fedcore.masked`'s. Every message must quote the task's id (its
own: `engine.base.node_task_id`), and each step comes once, in order: anything else is a
`ProtocolError` the caller logs and drops, so that a forged or replayed message can neither make the
node reveal a share twice nor mask against other neighbours.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedmq.fedcore.masked import GROUP, TENSOR, as_wire, weighted_change
from fedmq.fedcore.protocol import (
    ProtocolError,
    SecAggDirectory,
    SecAggKeys,
    SecAggReveal,
    SecAggShared,
    SecAggShares,
    SecAggUnmask,
)
from fedmq.fedcore.secagg import NodeSecAgg, RoundKey, SecAggError, SecAggSettings

STEPS = ("directory", "shared", "unmask")


@dataclass(frozen=True, slots=True)
class MaskedUpdate:
    """What the node sends as its update's tensors, and how many entries the clip changed."""

    tensors: dict[str, dict[str, torch.Tensor]]
    clipped: int


class SecureTask:
    """One task's secure aggregation on its node (module docstring)."""

    def __init__(
        self,
        settings: SecAggSettings,
        key: RoundKey,
        *,
        node: str,
        task_id: bytes,
        num_samples: int,
        random: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.node = node
        self.settings = settings
        self.task_id = task_id
        self.num_samples = num_samples
        self._secagg = NodeSecAgg(settings, key, node, random=random)
        self._done: set[str] = set()
        self._weight_total: int | None = None
        self._shares: Mapping[str, bytes] | None = None

    def keys(self) -> SecAggKeys:
        encryption, mask = self._secagg.public_keys()
        return SecAggKeys(task_id=self.task_id, encryption_key=encryption, mask_key=mask)

    def _step(self, name: str, task_id: bytes) -> None:
        if task_id != self.task_id:
            raise ProtocolError("foreign-task", f"a {name} message quotes another task than {self.node}'s")
        if name in self._done:
            raise ProtocolError("duplicate-secagg", f"a second {name} message for the same task")
        before = STEPS[: STEPS.index(name)]
        if not set(before) <= self._done:
            raise ProtocolError("secagg-out-of-step", f"a {name} message before the {', '.join(before)} step")
        self._done.add(name)

    def on_directory(self, message: SecAggDirectory) -> SecAggShares:
        """Share the node's seeds among its neighbours (their keys are in the directory)."""
        self._step("directory", message.task_id)
        if self.node in message.neighbours:
            raise ProtocolError("bad-secagg", f"the directory names {self.node} among its own neighbours")
        if self.settings.l2_clip is None and self.num_samples > message.weight_total:
            raise ProtocolError("bad-secagg", f"weight_total {message.weight_total} is below the node's own samples")
        try:
            commitment, shares = self._secagg.share(message.neighbours)
        except SecAggError as exc:
            raise ProtocolError(exc.reason, exc.detail) from None
        self._weight_total = message.weight_total
        return SecAggShares(task_id=self.task_id, commitment=commitment, shares=shares)

    def on_shared(self, message: SecAggShared) -> None:
        """Keep the shares addressed to the node: it masks against these neighbours."""
        self._step("shared", message.task_id)
        self._shares = dict(message.shares)

    @property
    def ready(self) -> bool:
        """Whether the node knows whom to mask against (then `mask` may be called)."""
        return self._shares is not None

    def mask(self, trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> MaskedUpdate:
        """The update's tensors: the weighted change from `base` (the model the task carried), masked."""
        return self.mask_change(weighted_change(trained, base, 1.0))

    def mask_change(self, change: np.ndarray) -> MaskedUpdate:
        """`change` (the trained model minus the one the task carried, `fedcore.masked.weighted_change`
        with weight 1) weighted by the node's samples over the directory's total, and masked."""
        if self._shares is None or self._weight_total is None:
            raise RuntimeError("mask needs the directory and shared steps first")
        if self.settings.l2_clip is None:
            vector = change * (self.num_samples / self._weight_total)
        else:  # central DP: clipped to S, weighted 1 / K (its estimator's fixed denominator)
            norm = float(np.linalg.norm(change))
            vector = change * (min(1.0, self.settings.l2_clip / norm) if norm > 0 else 1.0) / self._weight_total
        try:
            masked = self._secagg.mask(vector, self._shares.keys())
        except SecAggError as exc:
            raise ProtocolError(exc.reason, exc.detail) from None
        return MaskedUpdate({GROUP: {TENSOR: as_wire(masked.values)}}, masked.clipped)

    def on_unmask(self, message: SecAggUnmask) -> SecAggReveal:
        """Reveal what the coordinator asks for (never both shares of one node: `NodeSecAgg.reveal`)."""
        self._step("unmask", message.task_id)
        if self._shares is None:
            raise ProtocolError("secagg-out-of-step", "an unmask message before the shared step")
        try:
            reveal = self._secagg.reveal(self._shares, message.survivors, message.dropped)
        except SecAggError as exc:
            raise ProtocolError(exc.reason, exc.detail) from None
        return SecAggReveal(task_id=self.task_id, seed_shares=reveal.b_shares, key_shares=reveal.s_shares)
