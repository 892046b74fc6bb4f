"""FedDisco: federated learning with discrepancy-aware collaboration.

Ye, Xu, Wang, Xu, Chen and Wang, "FedDisco: Federated Learning with Discrepancy-Aware
Collaboration", ICML 2023, https://arxiv.org/abs/2305.19229; code
https://github.com/MediaBrain-SJTU/FedDisco (``disco.py``). Nodes train as in FedAvg and also report
d_k, the discrepancy between their label distribution and the global one; the coordinator
aggregates with

    p_k = ReLU(n_k / n - a d_k + b) / sum_j ReLU(n_j / n - a d_j + b)              (Eq. 8)

over the updates of the round (n = sum of their n_k), instead of FedAvg's n_k / n.

The discrepancy is the KL divergence from the uniform distribution, as in KDIA's code (its
``--measure_difference kl`` with ``global_dist`` uniform): d_k = sum_c P_k(c) log(C P_k(c)), in
[0, log C]. Each node computes it from its own label histogram, which stays on the node; only the
scalar travels (meta ``discrepancy``).

Paper vs code, and choices:
- `normalize` (default true, the code's ``get_distribution_difference`` for "kl"): each d_k is
  divided by the sum of this round's d_j (all zero stays zero) before Eq. 8; false uses the raw KL.
- The authors' code fails (NameError) when every ReLU is zero; here the round then falls back to
  FedAvg's weights, with a warning and the metric ``disco_fallback`` = 1.
- An update whose discrepancy is missing, not a number, negative, non-finite or above log C is left
  out of the average, with a warning and the metric ``disco_invalid``; if no update is left, the
  round fails with AlgorithmError.
- The global label distribution is taken as uniform (the KDIA setting: balanced training sets);
  the paper's non-uniform case would need the nodes' histograms on the coordinator.
- ``a = b = 0`` gives exactly FedAvg's weights (the weights are computed as
  max(0, n_k - n (a d_k - b)), proportional to p_k).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fedmq.fedcore.algorithms import base, fedavg, shared
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.errors import AlgorithmError

logger = logging.getLogger(__name__)

DISCREPANCY = "discrepancy"
"""The update meta key that carries d_k."""
_SLACK = 1e-9
"""Relative slack on the upper bound log C (the node computes d_k in floating point)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    a: float = 0.5
    """Weight of the discrepancy in Eq. 8, non-negative (KDIA paper and FedDisco's code: 0.5)."""
    b: float = 0.1
    """Offset in Eq. 8, non-negative (KDIA paper and FedDisco's code: 0.1)."""
    normalize: bool = True
    """Divide each d_k by the round's sum of d_j first, as the authors' code does for KL."""

    def __post_init__(self) -> None:
        base.require_non_negative(self, "a", "b")


def label_discrepancy(histogram: Sequence[int]) -> float:
    """KL(P || U) of the label distribution P given by `histogram` from the uniform U over its
    classes: sum_c P(c) log(C P(c)), 0 for balanced labels, log C for a single class."""
    total = sum(histogram)
    if total <= 0:
        raise ValueError("an empty label histogram has no distribution")
    classes = len(histogram)
    return math.fsum((n / total) * math.log(classes * n / total) for n in histogram if n > 0)


def disco_weights(num_samples: Sequence[int], discrepancies: Sequence[float], a: float, b: float) -> list[float]:
    """Aggregation weights proportional to FedDisco's p_k = ReLU(n_k / n - a d_k + b) (Eq. 8).

    Returned scaled by n, as max(0, n_k - n (a d_k - b)), so that a = b = 0 gives exactly the
    sample counts (FedAvg's weights); normalise them to get p_k. All zero when every ReLU clips.
    """
    n = float(sum(num_samples))
    return [max(0.0, float(n_k) - n * (a * d_k - b)) for n_k, d_k in zip(num_samples, discrepancies, strict=True)]


class CoordinatorHalf(shared.AveragingCoordinator[Hyperparams]):
    """Async mode: Eq. 8 (and the normalisation of d_k) runs over the buffer's updates in place of a
    round's; the weights need nothing else from the cohort."""

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        valid, discrepancies = [], []
        for update in updates:
            d_k = self._discrepancy(update)
            if d_k is None:
                continue
            valid.append(update)
            discrepancies.append(d_k)
        if not valid:
            raise AlgorithmError("no update of this round carries a valid discrepancy", round=ctx.round)
        if self.hp.normalize:
            total = math.fsum(discrepancies)
            discrepancies = [d / total if total > 0 else 0.0 for d in discrepancies]
        samples = [u.num_samples for u in valid]
        weights = disco_weights(samples, discrepancies, self.hp.a, self.hp.b)
        fallback = sum(weights) <= 0.0
        if fallback:
            logger.warning("round %d: every FedDisco weight clipped to zero; using FedAvg's weights", ctx.round)
            weights = [float(n) for n in samples]
        self.model.load_state_dict(self.next_model(ctx, valid, weights))
        return {
            "train_loss": shared.mean_reported_loss(valid, [float(n) for n in samples]),
            "disco_clipped": float(sum(w == 0.0 for w in weights)),
            "disco_invalid": float(len(updates) - len(valid)),
            "disco_fallback": float(fallback),
        }

    def _discrepancy(self, update: base.NodeUpdate) -> float | None:
        """The update's d_k, or None (with a warning) when it is not a usable number."""
        value = update.payload.meta.get(DISCREPANCY)
        d_k = base.wire_number(value)
        classes = getattr(self.model, "num_classes", None)
        upper = math.log(classes) * (1 + _SLACK) if isinstance(classes, int) and classes > 1 else math.inf
        if d_k is None or not 0 <= d_k <= upper:
            logger.warning(
                "round %d: update of %s carries no valid discrepancy (%r); left out of the average",
                update.round,
                update.node_id,
                value,
            )
            return None
        return d_k


class NodeHalf(fedavg.NodeHalf[Hyperparams]):
    """FedAvg's local training; the update also carries d_k (the histogram itself stays here)."""

    def __init__(self, hp: Hyperparams, *, node_id: str) -> None:
        super().__init__(hp, node_id=node_id)
        self._discrepancy: tuple[int, float] | None = None
        """(size of the data it was computed on, d_k): a node's shard does not change."""

    def train(
        self, task: base.TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator
    ) -> base.Payload:
        discrepancy = self.discrepancy(data, task.round)
        update = super().train(task, model, data, generator)
        return base.Payload(tensors=update.tensors, meta={**update.meta, DISCREPANCY: discrepancy})

    def train_group(self, members: Sequence[base.GroupMember], model: nn.Module) -> list[base.Payload]:
        """FedAvg's group training; each member's update carries its own d_k, from its own half."""
        discrepancies = [cast(NodeHalf, m.half).discrepancy(m.data, m.task.round) for m in members]
        updates = super().train_group(members, model)
        return [
            base.Payload(tensors=u.tensors, meta={**u.meta, DISCREPANCY: d})
            for u, d in zip(updates, discrepancies, strict=True)
        ]

    def discrepancy(self, data: TensorDataset, round: int) -> float:
        """d_k of this node's data, computed once (a node's shard does not change)."""
        if self._discrepancy is None or self._discrepancy[0] != len(data):
            try:
                self._discrepancy = (len(data), label_discrepancy(data.label_histogram()))
            except ValueError as exc:
                raise AlgorithmError(str(exc), node_id=self.node_id, round=round) from exc
        return self._discrepancy[1]


SPEC = base.AlgorithmSpec(name="feddisco", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=NodeHalf)
