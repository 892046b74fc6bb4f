"""The contract every registered method keeps (`fedcore.algorithms.ALGORITHMS`), one parametrised test
each, through the functions a user runs on their own method (`fedmq.testing.contract`, which says
what each promises): documented hyperparameters, bad ones refused as ConfigErrors (mistyped,
unknown, and each method's own out-of-range values, `BAD_HYPERPARAMETERS`), a round in process
through the coordinator's engine, a checkpoint that resumes exactly and one that does not fit
refused, aggregation in parts, and one fingerprint for both halves. Node halves keep their state in
memory only (no checkpoint API). The methods' own maths is tested in their own files."""

from __future__ import annotations

from typing import Any

import pytest

from fedmq.fedcore.algorithms import ALGORITHMS
from fedmq.testing import contract
from tests.algorithms.common import Federation

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


# -- hyperparameters -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_hyperparameters_are_documented_typed_and_checked(name: str) -> None:
    """Frozen, keyword-only, defaults valid, a doc line each and a module summary; a value of another
    type for any field, and a key that is no field, are ConfigErrors naming them."""
    contract.check_hyperparameters(name)


@pytest.mark.parametrize(
    ("name", "values", "match"),
    [(name, values, match) for name, rows in BAD_HYPERPARAMETERS.items() for values, match in rows],
)
def test_out_of_range_hyperparameters_are_refused(name: str, values: dict[str, Any], match: str | None) -> None:
    """Each method's out-of-range, non-finite and inconsistent values are ConfigErrors saying what is wrong."""
    contract.check_refused(name, values, match)


def test_every_method_lists_its_refusals() -> None:
    """A registered method without an entry in BAD_HYPERPARAMETERS (even an empty one) is a test to write."""
    assert sorted(BAD_HYPERPARAMETERS) == NAMES


# -- a round, a checkpoint, the fingerprint --------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_round_runs_in_process(name: str) -> None:
    """The updates fit the declared schema, the loss is finite, and the global model moves (noop's stays)."""
    contract.check_round(name, SMALL.get(name), model_moves=name != "noop")


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip_resumes_the_run_exactly(name: str) -> None:
    contract.check_checkpoint(name, SMALL.get(name))


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_that_does_not_fit_is_refused(name: str) -> None:
    contract.check_checkpoint_refusal(name, SMALL.get(name))


@pytest.mark.parametrize("name", NAMES)
def test_both_halves_give_one_fingerprint(name: str) -> None:
    contract.check_fingerprint(name, {"num_nodes": 4} if name == "kdia" else SMALL.get(name))


# -- aggregation in parts (hierarchical mode) ------------------------------------------------------

PARTIAL = {"fedavg", "fedavgm", "feddecorr", "fedlc", "fedntd", "fedprox", "fedrcl", "fedrs", "moon", "noop"}
"""The methods site aggregators may serve: their server is the sample-weighted mean (FedAvgM: with
momentum on it). Every other one says why not, and a hierarchical experiment with it is refused."""


@pytest.mark.parametrize("name", NAMES)
def test_aggregation_in_parts_equals_the_whole_or_is_refused(name: str) -> None:
    """Partial updates aggregated give what every node's update gives, or the method refuses in a sentence."""
    reason = Federation(name, dict(SMALL.get(name, {}))).coordinator.partial_refusal()
    assert (reason is None) == (name in PARTIAL), reason
    contract.check_aggregation_in_parts(name, SMALL.get(name))
