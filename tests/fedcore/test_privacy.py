"""Central differential privacy (issue 32, item 2; `fedcore.privacy`): DP-FedAvg's clipping and noise
against values computed by hand, the accountant against Opacus's own inverse, and the refusals."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.halfcalls import HalfCalls
from fedmq.experiments.config import parse_config
from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import NodeUpdate, RoundContext
from fedmq.fedcore.errors import AlgorithmError, ConfigError
from fedmq.fedcore.privacy import CentralDP, DPFedAvg
from fedmq.fedcore.seeding import torch_generator
from tests.algorithms.common import context, scalar_model
from tests.algorithms.common import update as node_update
from tests.coordinator.engine_helpers import config


def settings(**changes: Any) -> CentralDP:
    values: dict[str, Any] = {
        "noise_multiplier": 0.0, "clip_norm": 1.0, "delta": 1e-3, "cohort": 4, "nodes": 40, "seed": 7,
    } | changes  # fmt: skip
    return CentralDP(**values)


def aggregate(rule: DPFedAvg, states: Sequence[Mapping[str, torch.Tensor]], rnd: int = 0) -> dict[str, torch.Tensor]:
    rule.begin_round(context(rnd, ("a",)))
    return rule([dict(s) for s in states], [1.0] * len(states))


def test_clipping_and_the_fixed_denominator_by_hand() -> None:
    """From w = 0 with S = 1 and K = 4: changes 3 (norm 3, cut to 1) and 0.5 (kept) sum to 1.5, over K
    = 4 (not the 2 that came): 0.375. Weights are ignored (uniform), a weight of 0 leaves an update out."""
    rule = DPFedAvg(settings(), model=scalar_model(0.0))
    out = aggregate(rule, [{"weight": torch.full((1, 1), 3.0)}, {"weight": torch.full((1, 1), 0.5)}])
    assert out["weight"].item() == pytest.approx(0.375)
    assert rule.metrics["dp_clip_share"] == 0.5 and rule.metrics["dp_norm_median"] == pytest.approx(1.75)


def test_the_noise_is_the_rounds_own_stream_times_z_s_over_k() -> None:
    """z = 2, S = 0.5, K = 4 on a model of 10,000 zeros with no update change: w' = N(0, 1) draws of the
    stream (seed, "dp-noise", round, version) x z S / K, exactly; another round draws other noise; the
    empirical deviation is z S / K."""
    model = nn.Linear(100, 100, bias=False)
    nn.init.zeros_(model.weight)
    rule = DPFedAvg(settings(noise_multiplier=2.0, clip_norm=0.5), model=model)
    zero = {"weight": torch.zeros(100, 100)}
    out = aggregate(rule, [zero], rnd=3)
    draws = torch.randn((100, 100), generator=torch_generator(7, "dp-noise", 3, 0), dtype=torch.float64)
    torch.testing.assert_close(out["weight"], (draws * 2.0 * 0.5 / 4).float(), rtol=0, atol=1e-7)
    assert float(out["weight"].std()) == pytest.approx(0.25, rel=0.03) and rule.metrics["dp_noise_std"] == 0.25
    assert not torch.equal(aggregate(rule, [zero], rnd=4)["weight"], out["weight"])


def test_the_rule_needs_its_round_and_refuses_integer_entries() -> None:
    rule = DPFedAvg(settings(), model=scalar_model(0.0))
    with pytest.raises(RuntimeError, match="begin_round"):
        rule([{"weight": torch.zeros(1, 1)}], [1.0])
    with pytest.raises(ValueError, match="integer ones"):
        DPFedAvg(settings(), model=nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))


def test_epsilon_is_what_opacus_inverts_to_the_same_noise() -> None:
    """The accountant against the library's own reference: Opacus's get_noise_multiplier, asked for
    the epsilon we report after T rounds at q = K / N, gives back our z (to its search's precision);
    epsilon grows with the rounds and falls with the noise; rounds_within is the last round within."""
    dp = settings(noise_multiplier=1.1, cohort=10, nodes=100, delta=1e-5)
    eps = dp.epsilon(200)
    z = get_noise_multiplier(target_epsilon=eps, target_delta=1e-5, sample_rate=0.1, steps=200, accountant="rdp")
    assert z == pytest.approx(1.1, abs=0.01)
    assert dp.epsilon(100) < eps < dp.epsilon(400) and settings(noise_multiplier=2.0, cohort=10, nodes=100).epsilon(
        200
    ) < settings(noise_multiplier=1.1, cohort=10, nodes=100).epsilon(200)
    rounds = dp.rounds_within(eps)
    assert dp.epsilon(rounds) <= eps < dp.epsilon(rounds + 1) and rounds == 200
    assert dp.epsilon(0) == 0.0 and math.isinf(settings().epsilon(1))


class _BypassingHalf:
    """A coordinator half that averages by itself instead of through `average` (as no built-in does):
    central DP would then never see the updates."""

    def __init__(self, average: DPFedAvg) -> None:
        self.average = average
        self.model = average.model

    def aggregate(self, ctx: RoundContext, updates: Sequence[NodeUpdate], failures: object) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        pass

    def averaging_metrics(self) -> dict[str, float]:
        return {}

    def round_records(self) -> dict[str, Any]:
        return {}


def test_a_method_aggregating_around_its_averaging_rule_is_refused_by_the_calls() -> None:
    rule = DPFedAvg(settings(), model=scalar_model(0.0))
    updates = [node_update("a", {"weight": torch.zeros(1, 1)}, 10)]
    calls = HalfCalls(_BypassingHalf(rule), config())  # type: ignore[arg-type]
    with pytest.raises(AlgorithmError, match="aggregated without its averaging rule"):
        calls.aggregate(c.Aggregate(1, context(0, ("a",)), updates, []))
    spec = get_algorithm("fedavg")  # a method that does average through it: the rule ran, with its round
    half = spec.coordinator(build_hyperparams(spec, {}), model=scalar_model(0.0))
    half.average = DPFedAvg(settings(), model=half.model)
    aggregated, _ = HalfCalls(half, config()).aggregate(c.Aggregate(1, context(0, ("a",)), updates, []))
    assert "dp_epsilon" in aggregated.metrics and half.average.calls == 1


BASE = {"name": "x", "nodes": 20, "policy": {"fraction": 0.25}, "rounds": 50, "privacy": {"mechanism": "central"}}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine": {"kind": "async"}}, "it is for synchronous rounds"),
        ({"method": {"aggregator": {"name": "median"}}}, "it replaces the averaging rule"),
        ({"hierarchy": {"sites": 2}}, "site aggregators would see"),
        ({"privacy": {"mechanism": "central", "delta": 0.05}}, "delta 0.05 is not below 1 / nodes"),
        ({"privacy": {"mechanism": "central", "target_epsilon": 0.01}}, "one round already spends epsilon"),
        ({"privacy": {"mechanism": "central", "noise_multiplier": 0}}, "noise_multiplier"),
    ],
)
def test_what_central_dp_cannot_cover_is_refused_at_load(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(BASE | changes)


def test_a_target_epsilon_cuts_the_rounds_and_the_default_delta_is_a_tenth_of_one_over_n() -> None:
    cfg = parse_config(BASE | {"privacy": {"mechanism": "central", "target_epsilon": 3.0}})
    central = cfg.privacy.central(cfg.nodes, cfg.fraction, cfg.seed)
    assert central is not None and central.delta == pytest.approx(0.005) and central.cohort == 5
    assert cfg.steps == central.rounds_within(3.0) < 50 and central.epsilon(cfg.steps) <= 3.0
    assert parse_config(BASE).steps == 50


def test_adaptive_clipping_by_hand_moves_the_norm_by_the_noisy_unclipped_share() -> None:
    """Andrew et al. 2021: with C = 1, norms 3 and 0.5 leave one of K = 4 unclipped; the count's noise
    is the round stream's draw after the model's, sigma_b = K / 20 = 0.2; C <- C exp(-0.2 (b - 0.5)).
    The update's noise multiplier is what the count leaves of z: (z^-2 - (2 sigma_b)^-2)^-1/2."""
    dp = settings(noise_multiplier=0.3, adaptive=True)
    assert dp.count_sigma == pytest.approx(0.2)
    assert dp.update_noise_multiplier == pytest.approx((0.3**-2 - 0.4**-2) ** -0.5)
    rule = DPFedAvg(dp, model=scalar_model(0.0))
    aggregate(rule, [{"weight": torch.full((1, 1), 3.0)}, {"weight": torch.full((1, 1), 0.5)}], rnd=2)
    g = torch_generator(7, "dp-noise", 2, 0)
    torch.randn((1, 1), generator=g, dtype=torch.float64)  # the model's noise
    share = (1 + 0.2 * float(torch.randn((), generator=g, dtype=torch.float64))) / 4
    assert rule.metrics["dp_unclipped_estimate"] == pytest.approx(share)
    assert float(rule.clip_norm) == pytest.approx(math.exp(-0.2 * (share - 0.5)))
    assert rule.metrics["dp_clip_norm"] == 1.0  # the norm this round used
    with pytest.raises(ValueError, match=re.escape("2 x count_noise (0.2) above noise_multiplier (1)")):
        settings(noise_multiplier=1.0, adaptive=True, cohort=2)


def test_adaptive_clipping_finds_the_target_quantile_of_the_norms() -> None:
    """100 updates a round with norms spread evenly over (0, 2]: from C = 0.1, the clip norm settles
    near their median, 1, within 60 rounds (little noise: the count's sigma_b is 5, z small)."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    rule = DPFedAvg(settings(noise_multiplier=0.5, clip_norm=0.1, cohort=100, nodes=1000, adaptive=True), model=model)
    states = [{"weight": torch.full((1, 1), 2.0 * (k + 1) / 100)} for k in range(100)]
    for rnd in range(60):
        aggregate(rule, states, rnd=rnd)
        nn.init.zeros_(model.weight)  # the same norms every round
    assert float(rule.clip_norm) == pytest.approx(1.0, abs=0.15)


def test_the_adaptive_norm_is_checkpointed_with_the_half_and_restored() -> None:
    from fedmq.fedcore.algorithms.base import half_state, load_half_state

    spec = get_algorithm("fedavg")
    half = spec.coordinator(build_hyperparams(spec, {}), model=scalar_model(0.0))
    half.average = DPFedAvg(settings(noise_multiplier=0.3, adaptive=True), model=half.model)
    half.average.clip_norm.fill_(0.42)
    state = {k: v.clone() for k, v in half_state(half).items()}
    assert set(state) == {"average/clip_norm"}
    half.average.clip_norm.fill_(9.0)
    load_half_state(half, state)
    assert float(half.average.clip_norm) == 0.42
    plain = DPFedAvg(settings(), model=scalar_model(0.0))
    with pytest.raises(ValueError, match="adaptive clipping only"):
        plain.load_state_dict({"clip_norm": torch.ones(1)})


# -- node-level DP-SGD -------------------------------------------------------------------------------


def _dp_settings(**changes: Any) -> Any:
    from fedmq.fedcore.training import TrainSettings

    return TrainSettings(**({"batch_size": 4, "lr": 0.5, "max_grad_norm": 1.0, "dp_noise_multiplier": 0.7} | changes))


def test_dp_sgd_clips_each_samples_gradient_and_adds_the_seeded_noise_by_hand() -> None:
    """One DP-SGD step of a linear model on 4 samples: w' = w - lr (sum_i clip(g_i) + N(0, (z C)^2)) / B,
    with g_i each sample's gradient (torch.func, by hand), clipped to C = 1 over all parameters, and the
    noise drawn as Opacus draws it from a generator seeded by one draw of the node's generator."""
    from torch.func import functional_call, grad, vmap

    from fedmq.fedcore.data import TensorDataset
    from fedmq.fedcore.training import local_sgd

    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 3) * 3, torch.tensor([0, 1, 1, 0])
    data = TensorDataset(x, y, 2)
    settings = _dp_settings()
    node = torch.Generator().manual_seed(5)
    local_sgd(model, data, settings, node)

    replay = torch.Generator().manual_seed(5)
    seed = int(torch.randint(2**62, (1,), generator=replay))  # the noise's seed, drawn before training
    order = torch.randperm(4, generator=replay)
    xb, yb = x[order], y[order]

    shape = nn.Linear(3, 2)

    def loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(shape, params, (xi[None],)), yi[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(start, xb, yb)
    norms = torch.stack([g.reshape(4, -1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = (1.0 / (norms + 1e-6)).clamp(max=1.0)  # Opacus's clip factor
    noise = torch.Generator().manual_seed(seed)
    for name in ("weight", "bias"):  # Opacus draws the noise per parameter, in the model's order
        summed = torch.einsum("i,i...->...", factor, per_sample[name])
        drawn = torch.normal(mean=0, std=0.7 * 1.0, size=summed.shape, generator=noise)
        expected = start[name] - 0.5 * (summed + drawn) / 4
        torch.testing.assert_close(model.state_dict()[name], expected, rtol=0, atol=1e-5)
    # Opacus's hooks are gone: the same model trains plainly afterwards, with no per-sample gradients
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    assert not model._forward_hooks and not model._backward_hooks
    local_sgd(model, data, _dp_settings(dp_noise_multiplier=None, max_grad_norm=None), torch.Generator())


def test_tasks_without_dp_sgd_carry_the_same_train_settings_as_before() -> None:
    from fedmq.fedcore.training import TrainSettings

    assert "dp_noise_multiplier" not in TrainSettings().to_meta()
    meta = _dp_settings().to_meta()
    assert meta["dp_noise_multiplier"] == 0.7 and TrainSettings.from_meta(meta) == _dp_settings()
    with pytest.raises(ConfigError, match="with max_grad_norm set"):
        _dp_settings(max_grad_norm=None)


def test_a_nodes_epsilon_counts_every_step_of_every_task_it_was_given() -> None:
    """60 samples, batch 16: 4 batches an epoch (ceil), q = 16/60; 3 tasks of 2 epochs are 24 steps of
    the sampled Gaussian mechanism; the record counts a node's selections or its updates, the more."""
    from fedmq.fedcore.participation import ParticipationRecord
    from fedmq.fedcore.privacy import NodePrivacy, epsilon, node_epsilon

    settings = _dp_settings(batch_size=16, local_epochs=2, dp_noise_multiplier=1.0)
    assert node_epsilon(settings, 60, 3, 1e-4) == epsilon(1.0, 16 / 60, 24, 1e-4)
    record = ParticipationRecord()
    node = record.ensure("a", num_samples=60)
    node.rounds_selected, node.count, node.late = 2, 2, 1  # a late update too: 3 releases
    record.ensure("b", num_samples=60).rounds_selected = 1
    spent = NodePrivacy(settings, 1e-4).spent(record)
    assert spent == {"a": node_epsilon(settings, 60, 3, 1e-4), "b": node_epsilon(settings, 60, 1, 1e-4)}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"method": {"name": "fedprox"}}, "method 'fedprox' trains on its own objective"),
        ({"train": {"max_grad_norm": 1.0}}, "leave train.max_grad_norm unset"),
        ({"simulation": {"vectorize": True}}, "vectorised training has no per-sample clipping"),
        ({"privacy": {"mechanism": "node", "target_epsilon": 3}}, "are for the central mechanism"),
    ],
)
def test_what_node_dp_sgd_cannot_cover_is_refused_at_load(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(BASE | {"privacy": {"mechanism": "node"}} | changes)
