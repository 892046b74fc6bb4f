"""The contract every registered method keeps (`fedcore.algorithms.ALGORITHMS`), one parametrised test
each: its hyperparameters are documented as `fedmq methods` shows them, bad ones are refused as
ConfigErrors (mistyped, unknown, and each method's own out-of-range values, `BAD_HYPERPARAMETERS`),
a round runs in-process through the coordinator's engine (configure_round, train on every node,
aggregate), and a checkpoint (the global model and the coordinator half's `state_dict`) restores a
half that goes on exactly as the uninterrupted one, while a checkpoint that does not fit is
refused. Node halves keep their state in memory only (no checkpoint API), so the resumed run keeps
the same node halves. The methods' own maths is tested in their own files."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest
import torch

from fedmq.fedcore.algorithms import ALGORITHMS, build_hyperparams, describe
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from fedmq.fedcore.errors import ConfigError
from tests.algorithms.common import Federation, clone, context, same_state, tiny_model

NAMES = sorted(ALGORITHMS)
SMALL: dict[str, dict[str, Any]] = {
    "kdia": {"gen_epochs": 1, "gen_batches_per_epoch": 4, "gen_batch_size": 8, "noise_dim": 4},
}
"""Hyperparameters that keep a method's round short (KDIA's generator training)."""
BAD_HYPERPARAMETERS: dict[str, list[tuple[dict[str, Any], str | None]]] = {
    "fedavg": [],
    "noop": [],
    "fedacd": [
        ({"l2_weight": -1.0}, "l2_weight must be"),
        ({"l1_weight": float("nan")}, "l1_weight must be"),
        ({"l1_weight": 0.0, "l2_weight": 0.0}, "both be 0"),
        ({"tau": 1.0}, "tau must be in"),
        ({"tau": 0.0}, "tau must be in"),
        ({"mixup_alpha": -0.5}, "mixup_alpha must be"),
        ({"delta_missing": 0.0}, "delta_missing must be"),
        ({"eps": 0.0}, "eps must be"),
        ({"eps": 1.0}, "eps must be in"),
        ({"log_delta_clip": float("inf")}, "log_delta_clip must be"),
        ({"p_estimate": "ema"}, "p_estimate must be one of"),
        ({"kl_reduction": "max"}, "kl_reduction must be one of"),
        ({"weighting": "fedavg"}, "weighting must be one of"),
    ],
    "fedavgm": [
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"momentum": float("nan")}, "momentum"),
        ({"server_lr": 0}, "server_lr"),
        ({"server_lr": float("inf")}, "server_lr"),
    ],
    "feddecorr": [
        ({"beta": -0.01}, "beta"),
        ({"beta": float("inf")}, "beta"),
        ({"form": "frobenius"}, "form"),
    ],
    "feddisco": [
        ({"a": -0.1}, "a must be"),
        ({"b": -1}, "b must be"),
        ({"a": float("nan")}, "a must be"),
        ({"b": float("inf")}, "b must be"),
    ],
    "feddyn": [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"num_nodes": -3}, "num_nodes"),
    ],
    "fedgkd": [
        ({"gamma": -0.2}, "gamma"),
        ({"gamma": float("nan")}, "gamma"),
        ({"temperature": 0.0}, "temperature"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"kd_scale": "hinton"}, "kd_scale"),
    ],
    "fedlc": [
        ({"tau": -0.1}, "tau"),
        ({"tau": float("nan")}, "tau"),
        ({"tau": float("inf")}, "tau"),
    ],
    "fednh": [
        ({"smoothing": 1.5}, "smoothing"),
        ({"smoothing": -0.1}, "smoothing"),
        ({"smoothing": float("nan")}, "smoothing"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("inf")}, "scale"),
        ({"init": "random"}, "init"),
        ({"prototype_seed": -1}, "prototype_seed"),
    ],
    "fedntd": [
        ({"beta": -0.1}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"kd_scale": "hinton"}, "kd_scale"),
    ],
    "fedproto": [
        ({"proto_weight": -1.0}, "proto_weight"),
        ({"proto_weight": float("nan")}, "proto_weight"),
        ({"weighting": "samples"}, "weighting"),
        ({"prototype_pass": "test"}, "prototype_pass"),
    ],
    "fedprox": [
        ({"mu": -0.01}, "mu"),
        ({"mu": float("nan")}, "mu"),
        ({"mu": float("inf")}, "mu"),
    ],
    "fedrcl": [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"threshold": 1.5}, "threshold"),
        ({"threshold": float("nan")}, "threshold"),
        ({"beta": -1.0}, "beta"),
        ({"scl_weight": float("inf")}, "scl_weight"),
        ({"rcl_variant": "khosla"}, "rcl_variant"),
        ({"topk_pos": 0}, "topk_pos"),
        ({"topk_neg": 0}, "topk_neg"),
        ({"penalty_topk": -1}, "penalty_topk"),
        ({"taps": ""}, "taps"),
        ({"taps": "layer0,,layer1"}, "taps"),
        ({"taps": "layer0,layer0"}, "taps"),
        ({"local_lr_decay": 0.0}, "local_lr_decay"),
        ({"local_lr_decay": 1.5}, "local_lr_decay"),
    ],
    "fedrs": [
        ({"alpha": -0.1}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"scaling": "soft"}, "scaling"),
    ],
    "fedsa": [
        ({"cv_t": -0.1}, "cv_t"),
        ({"cv_t": 1.5}, "cv_t"),
        ({"sim_t": float("nan")}, "sim_t"),
        ({"c_mic": 0}, "c_mic"),
        ({"c_mic": 128}, "c_mic"),
        ({"s_mac": 0}, "s_mac"),
        ({"eps": 0.0}, "eps"),
        ({"cv_clip_quantile": 0.0}, "cv_clip_quantile"),
        ({"weighting": "mean"}, "weighting"),
        ({"bins": "log"}, "bins"),
        ({"buffers": "sa"}, "buffers"),
    ],
    "fedvls": [
        ({"lam": -0.1}, "lam"),
        ({"lam": float("nan")}, "lam"),
        ({"logit_scale": -1.0}, "logit_scale"),
        ({"prior_eps": 0.0}, "prior_eps"),
        ({"fedlc_tau": float("inf")}, "fedlc_tau"),
        ({"logit_suppression": "lade"}, "logit_suppression"),
        ({"calibration": "balanced"}, "calibration"),
        ({"teacher_bn": "train"}, "teacher_bn"),
        ({"aggregation": "all"}, "aggregation"),
    ],
    "kdia": [
        ({"kd_direction": "sideways"}, None),
        ({"weighting": "median"}, None),
        ({"teacher_mode": "approximate"}, None),
        ({"teacher_mode": "streaming", "weighting": "am"}, None),
        ({"lambda_kd": -0.1}, None),
        ({"temperature": 0.0}, None),
        ({"gen_batch_size": 1}, None),
        ({"store": "s3"}, None),
        ({"window_rounds": -1}, None),
    ],
    "moon": [
        ({"mu": -1.0}, "mu"),
        ({"mu": float("nan")}, "mu"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"previous_models": 0}, "previous_models"),
    ],
    "scaffold": [
        ({"server_lr": 0.0}, "server_lr"),
        ({"server_lr": -1.0}, "server_lr"),
        ({"server_lr": float("nan")}, "server_lr"),
        ({"control_update": "option_iii"}, "control_update must be one of"),
        ({"num_nodes": -1}, "num_nodes"),
    ],
}
"""Each method's own refusals: (values, what the error says), besides the mistyped and unknown keys
every method refuses (`test_mistyped_and_unknown_hyperparameters_are_refused`)."""


def _federation(name: str, seed: int = 0) -> Federation:
    return Federation(name, dict(SMALL.get(name, {})), seed=seed)


# -- hyperparameters -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameters_are_documented_with_defaults(name: str) -> None:
    """Every field of a frozen, keyword-only Hyperparams has a default and a doc line, and the module a summary."""
    spec = ALGORITHMS[name]
    params = spec.hyperparams.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen and all(f.kw_only for f in dataclasses.fields(spec.hyperparams))
    build_hyperparams(spec, {})  # every field has a default, and the defaults are valid
    undocumented = [option.name for option in describe.options(spec) if not option.doc]
    assert not undocumented, f"{name}: no doc line under {undocumented}"
    assert describe.summary(spec) != spec.name


@pytest.mark.parametrize("name", NAMES)
def test_mistyped_and_unknown_hyperparameters_are_refused(name: str) -> None:
    """A value of another type for any field, and a key that is no field, are ConfigErrors naming them."""
    spec = ALGORITHMS[name]
    wrong = {bool: "yes", int: "1", float: "0.5", str: 1}
    hints = typing.get_type_hints(spec.hyperparams)
    for field in dataclasses.fields(spec.hyperparams):
        with pytest.raises(ConfigError, match=field.name):
            build_hyperparams(spec, {field.name: wrong[hints[field.name]]})
    with pytest.raises(ConfigError, match="unknown hyperparameters"):
        build_hyperparams(spec, {"no_such_option": 1})


@pytest.mark.parametrize(
    ("name", "values", "match"),
    [(name, values, match) for name, rows in BAD_HYPERPARAMETERS.items() for values, match in rows],
)
def test_out_of_range_hyperparameters_are_refused(name: str, values: dict[str, Any], match: str | None) -> None:
    """Each method's out-of-range, non-finite and inconsistent values are ConfigErrors saying what is wrong."""
    with pytest.raises(ConfigError, match=match):
        build_hyperparams(ALGORITHMS[name], values)


def test_every_method_lists_its_refusals() -> None:
    """A registered method without an entry in BAD_HYPERPARAMETERS (even an empty one) is a test to write."""
    assert sorted(BAD_HYPERPARAMETERS) == NAMES


# -- a round, and a checkpoint ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_round_runs_in_process(name: str) -> None:
    """configure_round, every node's train, aggregate: the updates fit the declared schema (the engine
    rejects any other), the round reports a finite training loss, and the global model moves (noop's stays)."""
    fed = _federation(name)
    before = clone(fed.coordinator.model.state_dict())
    after = fed.run(1)
    assert len(fed.metrics) == 1 and math.isfinite(fed.metrics[0]["train_loss"])
    if name == "noop":  # the mean of identical models, up to rounding
        assert all(torch.allclose(before[k], after[k]) for k in before)
    else:
        assert not same_state(before, after)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_resumes_the_run_exactly(name: str) -> None:
    """The model and `state_dict` after round 0, loaded into a fresh coordinator half, give back the
    same state, and round 1 from there ends where the uninterrupted run does."""
    spec = ALGORITHMS[name]
    straight = _federation(name)
    expected = straight.run(2)
    resumed = _federation(name)
    resumed.run(1)
    saved_model = clone(resumed.coordinator.model.state_dict())
    saved_state = clone(resumed.coordinator.state_dict())
    fresh = spec.coordinator(build_hyperparams(spec, SMALL.get(name, {})), model=tiny_model(5))
    fresh.model.load_state_dict(saved_model)
    fresh.load_state_dict(saved_state)
    assert same_state(fresh.state_dict(), saved_state)
    resumed.coordinator = fresh
    assert same_state(resumed.run(1), expected)
    assert same_state(fresh.state_dict(), straight.coordinator.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_that_does_not_fit_is_refused(name: str) -> None:
    """An unexpected entry, and for a half with state a missing or misshapen one, is a ValueError."""
    fed = _federation(name)
    fed.run(1)
    coordinator = fed.coordinator
    state = clone(coordinator.state_dict())
    with pytest.raises(ValueError):
        coordinator.load_state_dict({**state, "no_such_entry": torch.zeros(1)})
    if state:
        key = sorted(state)[0]
        with pytest.raises(ValueError):
            coordinator.load_state_dict({k: v for k, v in state.items() if k != key})
        with pytest.raises(ValueError):
            coordinator.load_state_dict({**state, key: torch.zeros(7)})


# -- aggregation in parts (hierarchical mode) ------------------------------------------------------

PARTIAL = {"fedavg", "fedavgm", "feddecorr", "fedlc", "fedntd", "fedprox", "fedrcl", "fedrs", "moon", "noop"}
"""The methods site aggregators may serve: their server is the sample-weighted mean (FedAvgM: with
momentum on it). Every other one says why not, and a hierarchical experiment with it is refused."""


@pytest.mark.parametrize("name", NAMES)
def test_aggregation_in_parts_equals_the_whole_or_is_refused(name: str) -> None:
    """Two sites' partial updates (`partial`: each site's updates as one), aggregated, give the model
    and the training loss that aggregating every node's update gives, within float32 rounding; a
    method that cannot say so refuses in a sentence."""
    whole = _federation(name)
    reason = whole.coordinator.partial_refusal()
    assert (reason is None) == (name in PARTIAL), reason
    if reason is not None:
        assert len(reason) > 20 and reason[0].islower()
        with pytest.raises(NotImplementedError):
            whole.coordinator.partial([])
        return
    whole.run(1)  # a round first, so that server state (FedAvgM's velocity) is not zero
    payload = whole.coordinator.configure_round(context(1, whole.node_ids))
    assert isinstance(payload, Payload)
    updates = [whole.train(node, payload) for node in whole.node_ids]
    parted = _federation(name)
    parted.run(1)
    partials = []
    for site, members in enumerate((updates[:2], updates[2:])):
        merged, samples = parted.coordinator.partial(members)
        assert samples == sum(u.num_samples for u in members)
        partials.append(NodeUpdate(node_id=f"site-{site}", round=1, num_samples=samples, payload=merged))
    ctx = context(1, whole.node_ids)
    flat = whole.coordinator.aggregate(ctx, updates, [])
    tiered = parted.coordinator.aggregate(context(1, ("site-0", "site-1")), partials, [])
    assert flat["train_loss"] == pytest.approx(tiered["train_loss"], rel=1e-6)
    a, b = whole.coordinator.model.state_dict(), parted.coordinator.model.state_dict()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
