"""The method fingerprint: equal for equal settings, different for any shared setting, stable across
the wire, and naming what differs."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

from fedmq.broker import Kind, Message, decode, encode
from fedmq.fedcore.algorithms import ALGORITHMS, build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.fingerprint import MethodFingerprint, fingerprint_of, method_fingerprint
from fedmq.fedcore.models import build_model
from fedmq.fedcore.tensors import schema_of

SCHEMA = schema_of(build_model("mlp", (64,), 10, seed=0).state_dict())


def _fedprox(**hp: object) -> MethodFingerprint:
    spec = get_algorithm("fedprox")
    return fingerprint_of(spec.node(build_hyperparams(spec, hp), node_id="n"), SCHEMA)


def test_equal_settings_give_equal_digests_and_any_shared_setting_changes_it() -> None:
    assert _fedprox(mu=0.01).digest == _fedprox(mu=0.01).digest
    assert _fedprox(mu=0.01).digest != _fedprox(mu=0.1).digest
    other_model = schema_of(build_model("mlp", (64,), 10, seed=0, hidden=[32]).state_dict())
    spec = get_algorithm("fedprox")
    assert fingerprint_of(spec.node(build_hyperparams(spec, {}), node_id="n"), other_model).digest != (
        _fedprox().digest
    )


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_the_coordinator_half_and_the_node_half_of_a_method_agree(name: str) -> None:
    """Each registered method's two halves, built from the same hyperparameters, give one digest."""
    spec = ALGORITHMS[name]
    model = build_model("mlp", (64,), 10, seed=0)
    hp = build_hyperparams(spec, {"num_nodes": 4} if name == "kdia" else {})
    node = fingerprint_of(spec.node(hp, node_id="n"), schema_of(model.state_dict()))
    coordinator_half = spec.coordinator(hp, model=model)
    coordinator = fingerprint_of(coordinator_half, schema_of(coordinator_half.model.state_dict()))
    assert node.method == coordinator.method == name
    assert node.digest == coordinator.digest


def test_two_methods_with_the_same_settings_differ() -> None:
    fedavg, noop = (
        fingerprint_of(get_algorithm(n).node(build_hyperparams(get_algorithm(n), {}), node_id="n"), SCHEMA)
        for n in ("fedavg", "noop")
    )
    assert fedavg.digest != noop.digest
    assert fedavg.differences(noop) == "method: fedavg here, noop there"


def test_the_announced_description_survives_the_wire_and_its_digest_is_recomputed() -> None:
    ours = get_algorithm("kdia")
    mine = fingerprint_of(ours.node(build_hyperparams(ours, {"num_nodes": 4}), node_id="n"), SCHEMA)
    message = Message(kind=Kind.NODE_STATUS, federation="f", round=-1, sender="n", meta={"method": mine.to_meta()})
    back = MethodFingerprint.from_meta(decode(encode(message)).meta["method"])
    assert back == mine
    forged = {**mine.to_meta(), "hyperparams": {**mine.hyperparams, "lambda_kd": 9.0}}
    assert MethodFingerprint.from_meta(forged).digest != mine.digest  # the digest sent is not trusted


def test_differences_name_each_setting_with_both_values() -> None:
    assert _fedprox(mu=0.01).differences(_fedprox(mu=0.1), "here", "on the node") == "mu: 0.01 here, 0.1 on the node"
    assert _fedprox().differences(_fedprox()) == "none"


@dataclasses.dataclass(frozen=True)
class _WithLocal:
    alpha: float = 1.0
    store_dir: str = ""
    LOCAL_FIELDS: ClassVar[tuple[str, ...]] = ("store_dir",)


def test_local_fields_may_differ() -> None:
    a = method_fingerprint("m", _WithLocal(store_dir="/a"), SCHEMA)
    assert a.digest == method_fingerprint("m", _WithLocal(store_dir="/b"), SCHEMA).digest
    assert a.digest != method_fingerprint("m", _WithLocal(alpha=2.0), SCHEMA).digest
    assert "store_dir" not in a.hyperparams


@pytest.mark.parametrize(
    "meta",
    [
        "fedavg",
        {"method": "", "hyperparams": {}, "schema": "x"},
        {"method": "fedavg", "hyperparams": [], "schema": "x"},
        {"method": "fedavg", "hyperparams": {1: 2}, "schema": "x"},
        {"method": "fedavg", "hyperparams": {}, "schema": "x" * 65},
        {"method": "fedavg", "hyperparams": {"a": b"\x00"}, "schema": "x"},
    ],
)
def test_a_malformed_announcement_is_refused_with_a_reason(meta: object) -> None:
    with pytest.raises(ValueError, match="method"):
        MethodFingerprint.from_meta(meta)


def test_a_half_built_outside_the_registry_is_named_by_its_hyperparams_class() -> None:
    spec = get_algorithm("fedavg")

    class Custom(spec.node):  # type: ignore[name-defined,misc]
        pass

    @dataclasses.dataclass(frozen=True)
    class OwnHyperparams:
        rate: float = torch.pi

    fp = fingerprint_of(Custom(OwnHyperparams(), node_id="n"), SCHEMA)
    assert fp.method.endswith("OwnHyperparams") and fp.hyperparams == {"rate": torch.pi}


def test_kdia_s_store_and_logging_may_differ_between_machines_but_its_teacher_may_not() -> None:
    spec = get_algorithm("kdia")

    def fp(**hp: object) -> str:
        return fingerprint_of(spec.node(build_hyperparams(spec, {"num_nodes": 4, **hp}), node_id="n"), SCHEMA).digest

    assert fp(store="disk", store_dir="/tmp/a", teacher_log_every=0) == fp()
    assert fp(lambda_kd=0.1) != fp() and fp(teacher_mode="windowed") != fp()
