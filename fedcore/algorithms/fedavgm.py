"""FedAvgM: federated averaging with server momentum.

Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", arXiv 2019, https://arxiv.org/abs/1909.06335 (Section 3, "FedAvg with server
momentum"). Nodes train exactly as in FedAvg (FedAvg's node half, imported). The coordinator takes
the difference between the global model and the sample-weighted average of the updates as a
pseudo-gradient and runs momentum SGD on it:

    Delta_t = w_t - sum_k (n_k / n) w^k_{t+1}
    v_{t+1} = beta v_t + Delta_t                  (the paper; dampening: false)
    v_{t+1} = beta v_t + (1 - beta) Delta_t       (KDIA's code; dampening: true, the default)
    w_{t+1} = w_t - eta v_{t+1}

with beta = `momentum` and eta = `server_lr`; v_0 = 0.

Paper vs code: KDIA's Table 2 comes from its authors' code (kdia.md section 4), which dampens the
pseudo-gradient by (1 - beta). The dampened rule is the paper's rule with the server learning rate
eta (1 - beta): the same trajectory up to that rescaling. With the spec's beta = 0.9 and eta = 1 the
dampened rule has an effective step eta = 1 at steady state, the undampened one eta / (1 - beta) =
10. The default follows the code that produced the figures we compare with; ``dampening: false``
is the paper's literal rule.

Momentum applies to every floating entry of the state dict (parameters, and float buffers such as
BatchNorm's running statistics, as the KDIA code does); integer buffers (``num_batches_tracked``)
take the average's value. The velocity v is checkpointed with the model (`state_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedmq.fedcore.algorithms import base, fedavg, shared

VELOCITY = "velocity/"
"""Prefix of the velocity's entries in `CoordinatorHalf.state_dict`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Hyperparams:
    momentum: float = 0.9
    """Server momentum beta, in [0, 1) (the KDIA paper's alpha: grid 0.7, 0.9, 0.99; default 0.9)."""
    server_lr: float = 1.0
    """Server learning rate eta, positive (1.0: the spec)."""
    dampening: bool = True
    """Scale the pseudo-gradient by (1 - beta), as KDIA's code does; false gives the paper's rule."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        base.require_positive(self, "server_lr")


class CoordinatorHalf(shared.AveragingCoordinator[Hyperparams]):
    """Async mode: the target is `next_model`'s (a fedasync or fedbuff step instead of the average),
    Delta = w - target, and the momentum runs once per aggregation (per model version)."""

    sync_only = None
    aggregates_the_mean = True  # momentum on the sample-weighted mean: site aggregators may send partial means

    def __init__(self, hp: Hyperparams, *, model: nn.Module, device: torch.device | None = None) -> None:
        super().__init__(hp, model=model, device=device)
        floating = {name: t for name, t in model.state_dict().items() if t.is_floating_point()}
        self.velocity = {name: torch.zeros_like(t, dtype=shared.accumulator(t.dtype)) for name, t in floating.items()}
        """v, one tensor per floating entry of the model's state dict; zero before the first round."""

    def aggregate(
        self, ctx: base.RoundContext, updates: Sequence[base.NodeUpdate], failures: Sequence[base.Failure]
    ) -> Mapping[str, float]:
        weights = [float(u.num_samples) for u in updates]
        average = self.next_model(ctx, updates, weights)  # the target: the average in a sync round
        beta, eta = self.hp.momentum, self.hp.server_lr
        scale = 1.0 - beta if self.hp.dampening else 1.0
        new: dict[str, torch.Tensor] = {}
        for name, current in self.model.state_dict().items():
            avg = average[name]
            if name not in self.velocity:
                new[name] = avg  # integer buffers: the average's (the maximum over the updates)
                continue
            v = self.velocity[name]
            delta = current.to(v.dtype) - avg.to(v.dtype)  # the pseudo-gradient Delta_t = w_t - avg
            v.mul_(beta).add_(delta, alpha=scale)  # v_{t+1} = beta v_t + (1 - beta | 1) Delta_t
            # w_{t+1} = w_t - eta v_{t+1}, written as avg + (Delta_t - eta v_{t+1}): the same sum, and
            # exactly the average when beta = 0 and eta = 1 (then Delta_t - v_{t+1} is exactly 0)
            new[name] = (avg.to(v.dtype) + delta.sub_(v, alpha=eta)).to(current.dtype)
        self.model.load_state_dict(new)
        velocity_norm = shared.state_norm(self.velocity.values())
        return {"train_loss": shared.mean_reported_loss(updates, weights), "velocity_norm": velocity_norm}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {VELOCITY + name: v for name, v in self.velocity.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        shared.load_tensors(self.velocity, state, VELOCITY, owner="FedAvgM", what="velocity")


SPEC = base.AlgorithmSpec(name="fedavgm", hyperparams=Hyperparams, coordinator=CoordinatorHalf, node=fedavg.NodeHalf)
