"""FedSA: parameter-skew-aware aggregation (SA) in place of FedAvg's weighted mean.

Wang, Liao, Yuan and Zhang, "The Key of Parameter Skew in Federated Learning", arXiv 2024,
https://arxiv.org/abs/2408.11278 (v1; v2 renames the method FedPake). Nodes train exactly as in
FedAvg (FedAvg's node half); only the server's averaging changes. That averaging rule is generic (any
method whose server averages models may use it as ``method.aggregator`` "fedsa"), so it lives in
`fedcore.aggregation.skew_aware`, which documents the equations and every reading of the paper. What
is FedSA's own stays here: the method's hyperparameters (SA's options and the per-tensor log switch)
and the server half that reports SA's statistics each round (metrics, the ``fedsa_layers`` log).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedmq.fedcore.aggregation import skew_aware
from fedmq.fedcore.algorithms import base, fedavg


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams(skew_aware.SkewAwareOptions):
    """SA's options (`skew_aware.SkewAwareOptions`, defaults: the paper's CIFAR-10 settings) and
    what only the method does with them: log each tensor's statistics."""

    log_layers: bool = True
    """Write per-tensor diagnostics (size, high-dispersion count, cluster sizes, unclustered nodes)
    to the run's ``fedsa_layers.jsonl`` every round (spec 6.4)."""


class CoordinatorHalf(fedavg.CoordinatorHalf[Hyperparams]):
    """FedAvg's server with SA as its averaging step (FedSA = FedAvg + SA, paper section "SA")."""

    sync_only = (
        "FedSA's skew-aware aggregator computes its dispersion statistics and clusters over one round's "
        "client models, and asynchronous aggregation folds stale updates with the 'mean' aggregator only"
    )

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        self.average = skew_aware.aggregator(hp, model=model, device=self.device)
        self._records: list[dict[str, Any]] = []

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        metrics = dict(super().aggregate(ctx, updates, failures))
        self._records = []
        if isinstance(self.average, skew_aware.SkewAwareAggregator):
            metrics.update(self.average.metrics)
            if self.hp.log_layers:
                ids = [u.node_id for u in updates]
                self._records = [
                    {
                        "round": ctx.round,
                        "layer": layer.name,
                        "size": layer.size,
                        "high": layer.high,
                        "cluster_sizes": [len(c) for c in layer.clusters],
                        "unclustered": [ids[i] for i in layer.unclustered],
                    }
                    for layer in self.average.layers
                ]
        return metrics

    def round_records(self) -> Mapping[str, Sequence[Mapping[str, Any]]]:
        return {"fedsa_layers": self._records} if self._records else {}


SPEC = base.AlgorithmSpec(name="fedsa", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=fedavg.NodeHalf)
