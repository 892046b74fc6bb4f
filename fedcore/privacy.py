"""Central differential privacy for the averaging methods: DP-FedAvg with a privacy accountant.

McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language Models",
ICLR 2018 (https://arxiv.org/abs/1710.06963), Algorithm 1 with the fixed-denominator estimator and
uniform weights: each round K of the N nodes are selected (q = K / N); every update's change from
the global model, d_k = w_k - w, is clipped to L2 norm at most S (over every floating entry), and

    w' = w + (sum_k min(1, S / ||d_k||) d_k + N(0, (z S)^2 I)) / K

with z the noise multiplier. K is the configured cohort, not the count that arrived: the sum's
sensitivity to one node is S whatever the others do, and a round with stragglers moves the model
less instead of revealing how many answered. The guarantee is user-level (one node's whole data)
for the released models, against everyone but the coordinator, which sees the updates in clear
unless secure aggregation hides them (`fedcore.secagg`: the nodes then clip and divide by K, and
`DPFedAvg.release` adds the noise to the unmasked sum).

The privacy spent is tracked by the Renyi-DP accountant of Opacus (Mironov 2017; Mironov, Talwar and
Zhang 2019, the sampled Gaussian mechanism), as a function of (z, q, rounds): epsilon for the
configured delta after each round. Opacus analyses Poisson sampling; fedmq selects exactly K nodes
without replacement, the usual approximation in the federated DP literature (McMahan et al. 2018,
section 3), said here and in docs/privacy.md.

What it does not cover: integer entries of the model (BatchNorm's ``num_batches_tracked`` would be
released without noise), so such models are refused; asynchronous folding, robust rules and site
aggregators, refused when the experiment is loaded.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from fedmq.fedcore.algorithms.base import RoundContext
from fedmq.fedcore.participation import ParticipationRecord
from fedmq.fedcore.seeding import torch_generator
from fedmq.fedcore.tensors import StateDict
from fedmq.fedcore.training import TrainSettings

ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 128, 256, 512, 1024]
"""The Renyi orders the accountant tries (Opacus's defaults and a few larger, for small epsilons)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CentralDP:
    """The mechanism's settings, from the experiment (``privacy:``)."""

    noise_multiplier: float
    """z: the noise's standard deviation in units of the clip norm."""
    clip_norm: float
    """S: the largest L2 norm an update's change from the global model keeps."""
    delta: float
    """The delta the epsilon is reported for (below 1 / N)."""
    cohort: int
    """K: the nodes a round selects, the estimator's fixed denominator."""
    nodes: int
    """N: the federation's nodes (q = K / N)."""
    seed: int
    """The run's seed: each round's noise comes from its own stream (seed, "dp-noise", round, version)."""
    adaptive: bool = False
    """Adaptive clipping (Andrew et al. 2021): clip_norm is where the norm starts; each round it moves
    geometrically toward the `target_quantile` of the updates' norms, estimated privately."""
    target_quantile: float = 0.5
    """gamma: the share of updates the clip norm should leave unclipped."""
    clip_learning_rate: float = 0.2
    """eta_C: C <- C exp(-eta_C (b - gamma)), b the noisy share of unclipped updates."""
    count_noise: float | None = None
    """sigma_b: the noise on the count of unclipped updates; None: K / 20 (the paper's choice)."""

    def __post_init__(self) -> None:
        if not (0 <= self.noise_multiplier < math.inf and 0 < self.clip_norm < math.inf and 0 < self.delta < 1):
            raise ValueError("noise_multiplier >= 0, clip_norm > 0 and 0 < delta < 1 are needed")
        if not 1 <= self.cohort <= self.nodes:
            raise ValueError(f"the cohort ({self.cohort}) must be between 1 and the nodes ({self.nodes})")
        if self.adaptive and not 2 * self.count_sigma > self.noise_multiplier > 0:
            raise ValueError(
                f"adaptive clipping spends part of the noise on the count of unclipped updates: it needs"
                f" 2 x count_noise ({2 * self.count_sigma:g}) above noise_multiplier ({self.noise_multiplier:g});"
                " raise count_noise (default K / 20) or select more nodes a round"
            )

    @property
    def count_sigma(self) -> float:
        """sigma_b, resolved."""
        return self.count_noise if self.count_noise is not None else self.cohort / 20

    @property
    def update_noise_multiplier(self) -> float:
        """The noise multiplier of the update sum: z itself, or with adaptive clipping what the count's
        noise leaves of it, (z^-2 - (2 sigma_b)^-2)^(-1/2) (Andrew et al. 2021, Theorem 1), so that the
        two releases together are as private as one Gaussian mechanism of multiplier z."""
        if not self.adaptive:
            return self.noise_multiplier
        return (self.noise_multiplier**-2 - (2 * self.count_sigma) ** -2) ** -0.5

    @property
    def sample_rate(self) -> float:
        return self.cohort / self.nodes

    @property
    def noise_std(self) -> float:
        """The standard deviation of the noise on the model at the starting clip norm: z S / K."""
        return self.update_noise_multiplier * self.clip_norm / self.cohort

    def epsilon(self, rounds: int) -> float:
        """The epsilon spent after `rounds` rounds, for `delta` (inf without noise)."""
        return epsilon(self.noise_multiplier, self.sample_rate, rounds, self.delta)

    def rounds_within(self, target: float) -> int:
        """The most rounds whose epsilon stays at or below `target` (0 if even one exceeds it)."""
        low, high = 0, 1
        while self.epsilon(high) <= target:
            low, high = high, high * 2
            if high > 1 << 24:
                return low  # the last count checked: more rounds than any run has
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.epsilon(middle) <= target else (low, middle)
        return low


def default_delta(nodes: int) -> float:
    """The delta reported when the experiment names none: a tenth of 1 / nodes, below the 1 / N at which
    a mechanism could publish one node's data outright and still claim it."""
    return 0.1 / max(nodes, 1)


@lru_cache(maxsize=4096)
def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """Opacus's RDP accountant for `rounds` steps of the sampled Gaussian mechanism."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    from opacus.accountants import RDPAccountant  # only runs with privacy need it

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, rounds)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
        return float(accountant.get_epsilon(delta, alphas=ALPHAS))


class DPFedAvg:
    """The averaging rule of central DP (module docstring), in place of a method's weighted mean.

    `begin_round` gives it the round (the coordinator's calls do, `coordinator.halfcalls`); each call
    then clips, sums, adds that round's noise and divides by the cohort, and keeps its `metrics`."""

    def __init__(self, settings: CentralDP, *, model: nn.Module) -> None:
        integers = [name for name, value in model.state_dict().items() if not value.is_floating_point()]
        if integers:
            raise ValueError(
                f"central DP adds noise to floating entries only, and the model holds integer ones ({integers[:3]},"
                " BatchNorm's batch counts) that would be released without it: use a model without BatchNorm"
            )
        self.settings = settings
        self.model = model
        self.clip_norm = torch.tensor([settings.clip_norm], dtype=torch.float64)
        """C, the clip norm of the next round (moved each round with adaptive clipping; checkpointed)."""
        self._round: tuple[int, int] | None = None
        self.calls = 0
        """Calls so far: a method whose aggregation never calls its averaging rule cannot be private."""
        self.metrics: dict[str, float] = {}

    def begin_round(self, ctx: RoundContext) -> None:
        self._round = (ctx.round, ctx.version)

    def _take_round(self) -> tuple[int, torch.Generator]:
        """The round `begin_round` gave (used once: each release is a round's) and its noise stream."""
        if self._round is None:
            raise RuntimeError("DPFedAvg needs begin_round before each aggregation (its noise is the round's)")
        rnd, version = self._round
        self._round = None
        self.calls += 1
        return rnd, torch_generator(self.settings.seed, "dp-noise", rnd, version)

    def _release_metrics(self, rnd: int, clip: float) -> dict[str, float]:
        s = self.settings
        noise_std = s.update_noise_multiplier * clip / s.cohort
        return {"dp_epsilon": s.epsilon(rnd + 1), "dp_delta": s.delta, "dp_noise_std": noise_std, "dp_clip_norm": clip}

    def __call__(self, states: Sequence[StateDict], weights: Sequence[float]) -> StateDict:
        rnd, generator = self._take_round()
        s = self.settings
        clip = float(self.clip_norm)
        current = self.model.state_dict()
        counted = [state for state, weight in zip(states, weights, strict=True) if float(weight) > 0]
        norms = [_norm(current, state) for state in counted]
        scales = [min(1.0, clip / norm) if norm > 0 else 1.0 for norm in norms]
        out: StateDict = {}
        for name, now in current.items():
            wide = now.to(torch.float64)
            total = torch.zeros_like(wide)
            for state, scale in zip(counted, scales, strict=True):
                total.add_(state[name].to(torch.float64) - wide, alpha=scale)
            noise = torch.randn(now.shape, generator=generator, dtype=torch.float64)
            total.add_(noise, alpha=s.update_noise_multiplier * clip)
            out[name] = (wide + total / s.cohort).to(now.dtype)
        self.metrics = self._release_metrics(rnd, clip) | {
            "dp_clip_share": sum(norm > clip for norm in norms) / len(norms) if norms else 0.0,
            "dp_norm_median": statistics.median(norms) if norms else 0.0,
        }
        if s.adaptive:  # after the model's noise, from the same stream: the count's own
            unclipped = sum(norm <= clip for norm in norms)
            count_noise = float(torch.randn((), generator=generator, dtype=torch.float64))
            share = (unclipped + s.count_sigma * count_noise) / s.cohort
            self.clip_norm.fill_(clip * math.exp(-s.clip_learning_rate * (share - s.target_quantile)))
            self.metrics["dp_unclipped_estimate"] = share
        return out

    def release(self, change: StateDict) -> StateDict:
        """With secure aggregation: the nodes clipped their changes to the clip norm and divided them by
        the cohort before masking, so `change` is their unmasked sum, sum_k clip(d_k) / K. This adds the
        round's noise, z S / K, from the same stream and in the same order as a call would, and returns
        the next model. The accountant's figures are the same; the clipped share and the norms, which
        only the nodes saw, are not reported."""
        if self.settings.adaptive:
            raise RuntimeError("adaptive clipping needs the count of unclipped updates, which the masks hide")
        rnd, generator = self._take_round()
        s = self.settings
        clip = float(self.clip_norm)
        out: StateDict = {}
        for name, now in self.model.state_dict().items():
            noise = torch.randn(now.shape, generator=generator, dtype=torch.float64)
            total = change[name].to(torch.float64) + noise * (s.update_noise_multiplier * clip / s.cohort)
            out[name] = (now.to(torch.float64) + total).to(now.dtype)
        self.metrics = self._release_metrics(rnd, clip)
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The clip norm of the next round (`coordinator` checkpoints it with the half's state)."""
        return {"clip_norm": self.clip_norm} if self.settings.adaptive else {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        if set(state) != ({"clip_norm"} if self.settings.adaptive else set()):
            raise ValueError(f"central DP's state is its clip norm with adaptive clipping only, got {sorted(state)}")
        if state:
            self.clip_norm.copy_(state["clip_norm"])

    def summary(self, rounds_completed: int) -> dict[str, Any]:
        """What summary.json says of the privacy spent by `rounds_completed` rounds."""
        s = self.settings
        return {
            "mechanism": "central",
            "epsilon": s.epsilon(rounds_completed),
            "delta": s.delta,
            "noise_multiplier": s.noise_multiplier,
            "clip_norm": float(self.clip_norm) if s.adaptive else s.clip_norm,
            "adaptive_clipping": s.adaptive,
            "sample_rate": s.sample_rate,
            "rounds": rounds_completed,
            "accountant": "opacus RDP (Poisson sampling assumed)",
        }


def _norm(current: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> float:
    """||state - current|| over every (floating) entry, summed in float64 in key order."""
    return math.sqrt(sum(float((state[k].double() - v.double()).square().sum()) for k, v in current.items()))


def private_training(
    model: nn.Module, optimizer: torch.optim.Optimizer, settings: TrainSettings, generator: torch.Generator
) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """Node-level DP-SGD for `local_sgd` (Abadi et al., "Deep Learning with Differential Privacy", CCS
    2016), with Opacus's per-sample gradients (`GradSampleModule`) and its `DPOptimizer`: each sample's
    gradient is clipped to ``max_grad_norm``, the batch's sum gets N(0, (z max_grad_norm)^2) noise and
    is divided by the batch size. The noise comes from a generator seeded by one draw of the node's
    own (so a run replays); the returned function removes Opacus's hooks from `model` afterwards."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    assert settings.dp_noise_multiplier is not None and settings.max_grad_norm is not None
    # Opacus's hooks fire on the first layer, whose input needs no gradient: expected, said once per step
    warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
    device = next(model.parameters()).device
    noise = torch.Generator(device=device)
    noise.manual_seed(int(torch.randint(2**62, (1,), generator=generator, device=generator.device)))
    wrapped = GradSampleModule(model)
    private = DPOptimizer(
        optimizer,
        noise_multiplier=settings.dp_noise_multiplier,
        max_grad_norm=settings.max_grad_norm,
        expected_batch_size=settings.batch_size,
        generator=noise,
    )
    return wrapped, private, wrapped._close


def node_epsilon(settings: TrainSettings, num_samples: int, tasks: int, delta: float) -> float:
    """The epsilon a node spent by training `tasks` tasks with DP-SGD on `num_samples` samples: the
    sampled Gaussian mechanism at q = batch / samples for every step it may have taken (ceil(n / B)
    batches an epoch, the most local_sgd takes). Opacus's accountant assumes Poisson batches; local_sgd
    shuffles and cuts, the usual approximation (Abadi et al. 2016 make it too)."""
    if settings.dp_noise_multiplier is None or tasks <= 0 or num_samples <= 0:
        return 0.0
    batches = num_samples // settings.batch_size if settings.drop_last else -(-num_samples // settings.batch_size)
    rate = min(1.0, settings.batch_size / num_samples)
    return epsilon(settings.dp_noise_multiplier, rate, tasks * settings.local_epochs * max(batches, 1), delta)


@dataclass(frozen=True, slots=True)
class NodePrivacy:
    """What node DP-SGD has spent, per node, from the coordinator's participation record: a node is
    counted for every task it was selected for, or every update it sent, whichever is more (a task
    trained and its update lost or discarded still released it), so the figure errs high, never low."""

    settings: TrainSettings
    delta: float

    def spent(self, record: ParticipationRecord) -> dict[str, float]:
        return {
            node.node_id: node_epsilon(
                self.settings, node.num_samples, max(node.rounds_selected, node.count + node.late + node.rejected),
                self.delta,
            )
            for node in record
        }  # fmt: skip

    def metrics(self, record: ParticipationRecord) -> dict[str, float]:
        """The largest epsilon any node has spent so far, for a metrics line."""
        spent = self.spent(record)
        return {"node_dp_epsilon_max": max(spent.values(), default=0.0), "node_dp_delta": self.delta}

    def summary(self, record: ParticipationRecord) -> dict[str, Any]:
        spent = self.spent(record)
        return {
            "mechanism": "node",
            "epsilon_max": max(spent.values(), default=0.0),
            "epsilon_by_node": dict(sorted(spent.items())),
            "delta": self.delta,
            "noise_multiplier": self.settings.dp_noise_multiplier,
            "clip_norm": self.settings.max_grad_norm,
            "accountant": "opacus RDP over each node's DP-SGD steps (Poisson batches assumed)",
        }
