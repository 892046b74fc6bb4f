"""The contract every method, model and dataset keeps, built-in or a user's: fedmq's own tests check
each built-in one with these functions, and a user calls them on their own (`check_method`,
`check_model`, `check_dataset`) from their tests. A broken promise is a `ContractError` (an
AssertionError, so pytest shows it as a failed check) that says which promise and what was seen.

A method: its Hyperparams are a frozen, keyword-only dataclass whose fields all have valid defaults
and a doc line (what `fedmq methods` shows), values of the wrong type and unknown keys are refused as
ConfigErrors naming them (and the method's own out-of-range values, `bad`); a round runs in process
through the coordinator's engine (configure_round, every node's train, aggregate) with a finite
training loss and a global model that moves; a checkpoint (the model and the coordinator half's
`state_dict`) restores a half that goes on exactly as the uninterrupted one, and one that does not
fit is a ValueError; aggregating in parts (site aggregators) equals aggregating the whole, or is
refused with a reason; and both halves give the same method fingerprint.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, describe, get_algorithm
from fedmq.fedcore.algorithms.base import AlgorithmSpec, NodeUpdate, Payload
from fedmq.fedcore.algorithms.fingerprint import fingerprint_of
from fedmq.fedcore.data import Split, check_split, dataset_schema, load_dataset, schema_of_split
from fedmq.fedcore.errors import ConfigError
from fedmq.fedcore.models import build_model
from fedmq.fedcore.tensors import schema_of
from fedmq.testing.federation import Federation, clone, context, same_state, tiny_model


class ContractError(AssertionError):
    """A method, model or dataset breaks a promise fedmq relies on; the message says which."""


def _require(ok: object, message: str) -> None:
    if not ok:
        raise ContractError(message)


def _spec(method: str | AlgorithmSpec) -> AlgorithmSpec:
    return method if isinstance(method, AlgorithmSpec) else get_algorithm(method)


# -- methods ---------------------------------------------------------------------------------------


def check_method(
    method: str | AlgorithmSpec,
    hyperparams: Mapping[str, Any] | None = None,
    *,
    bad: Iterable[tuple[Mapping[str, Any], str | None]] = (),
    model_moves: bool = True,
) -> None:
    """Every check below on `method` (a name as an experiment file gives it, e.g. "my_package.my_method",
    or an AlgorithmSpec), run with `hyperparams` (its defaults when None; small values keep it quick).
    `bad`: (values, what the ConfigError says) pairs its Hyperparams must refuse. `model_moves`: False for
    a method whose global model may stay as it is after a round."""
    spec = _spec(method)
    values = dict(hyperparams or {})
    check_hyperparameters(spec)
    for refused, match in bad:
        check_refused(spec, refused, match)
    check_round(spec, values, model_moves=model_moves)
    check_checkpoint(spec, values)
    check_checkpoint_refusal(spec, values)
    check_aggregation_in_parts(spec, values)
    check_fingerprint(spec, values)


def check_hyperparameters(method: str | AlgorithmSpec) -> None:
    """Frozen, keyword-only Hyperparams with valid defaults, each field documented, a module summary;
    a value of another type for any plain field and an unknown key are ConfigErrors naming them."""
    spec = _spec(method)
    params = getattr(spec.hyperparams, "__dataclass_params__", None)
    fields = dataclasses.fields(spec.hyperparams)
    _require(
        params is not None and params.frozen and all(f.kw_only for f in fields),
        f"{spec.name}: Hyperparams must be @dataclass(frozen=True, kw_only=True)",
    )
    try:
        build_hyperparams(spec, {})
    except ConfigError as exc:
        raise ContractError(f"{spec.name}: the default hyperparameters are refused: {exc}") from None
    undocumented = [option.name for option in describe.options(spec) if not option.doc]
    _require(not undocumented, f"{spec.name}: write a docstring line under each of {undocumented}")
    _require(describe.summary(spec) != spec.name, f"{spec.name}: give its module a docstring (its summary)")
    wrong: dict[object, object] = {bool: "yes", int: "1", float: "0.5", str: 1}
    hints = typing.get_type_hints(spec.hyperparams)
    for field in fields:
        if hints[field.name] in wrong:
            _expect_refusal(spec, {field.name: wrong[hints[field.name]]}, field.name)
    _expect_refusal(spec, {"no_such_option": 1}, "unknown hyperparameters")


def check_refused(method: str | AlgorithmSpec, values: Mapping[str, Any], match: str | None = None) -> None:
    """`values` are a ConfigError (saying `match`, a regular expression, when given)."""
    _expect_refusal(_spec(method), values, match)


def _expect_refusal(spec: AlgorithmSpec, values: Mapping[str, Any], match: str | None) -> None:
    try:
        build_hyperparams(spec, values)
    except ConfigError as exc:
        _require(
            match is None or re.search(match, str(exc)), f"{spec.name}: {values} refused as {exc!s}, not {match!r}"
        )
        return
    raise ContractError(f"{spec.name}: hyperparameters {values} are accepted; they must be a ConfigError")


def check_round(
    method: str | AlgorithmSpec, hyperparams: Mapping[str, Any] | None = None, *, model_moves: bool = True
) -> None:
    """One round through the engine: the updates fit the declared schema (the engine rejects others),
    the round reports a finite training loss, and the global model moves (stays, up to rounding, if not
    `model_moves`)."""
    spec = _spec(method)
    fed = Federation(spec, dict(hyperparams or {}))
    before = clone(fed.coordinator.model.state_dict())
    after = fed.run(1)
    _require(len(fed.metrics) == 1, f"{spec.name}: one round gave {len(fed.metrics)} aggregations")
    loss = fed.metrics[0].get("train_loss")
    _require(isinstance(loss, float) and math.isfinite(loss), f"{spec.name}: the round's train_loss is {loss!r}")
    if model_moves:
        _require(not same_state(before, after), f"{spec.name}: the global model did not move in a round")
    else:
        _require(all(torch.allclose(before[k], after[k]) for k in before), f"{spec.name}: the global model moved")


def check_checkpoint(method: str | AlgorithmSpec, hyperparams: Mapping[str, Any] | None = None) -> None:
    """The model and `state_dict` after round 0, loaded into a fresh coordinator half, give back the same
    state, and round 1 from there ends where the uninterrupted run does."""
    spec = _spec(method)
    values = dict(hyperparams or {})
    straight = Federation(spec, values)
    expected = straight.run(2)
    resumed = Federation(spec, values)
    resumed.run(1)
    saved_model = clone(resumed.coordinator.model.state_dict())
    saved_state = clone(resumed.coordinator.state_dict())
    fresh = spec.coordinator(build_hyperparams(spec, values), model=tiny_model(5))
    fresh.model.load_state_dict(saved_model)
    fresh.load_state_dict(saved_state)
    _require(same_state(fresh.state_dict(), saved_state), f"{spec.name}: load_state_dict did not restore state_dict")
    resumed.coordinator = fresh
    _require(same_state(resumed.run(1), expected), f"{spec.name}: a resumed run ends elsewhere than an uncut one")
    _require(
        same_state(fresh.state_dict(), straight.coordinator.state_dict()),
        f"{spec.name}: a resumed half's state differs from the uncut run's",
    )


def check_checkpoint_refusal(method: str | AlgorithmSpec, hyperparams: Mapping[str, Any] | None = None) -> None:
    """An unexpected entry, and for a half with state a missing or misshapen one, is a ValueError."""
    spec = _spec(method)
    fed = Federation(spec, dict(hyperparams or {}))
    fed.run(1)
    coordinator = fed.coordinator
    state = clone(coordinator.state_dict())
    cases = [("an unexpected entry", {**state, "no_such_entry": torch.zeros(1)})]
    if state:
        key = sorted(state)[0]
        cases += [
            (f"without {key}", {k: v for k, v in state.items() if k != key}),
            (f"a misshapen {key}", {**state, key: torch.zeros(7)}),
        ]
    for what, bad in cases:
        try:
            coordinator.load_state_dict(bad)
        except ValueError:
            continue
        raise ContractError(f"{spec.name}: load_state_dict accepted a checkpoint with {what}; raise ValueError")


def check_aggregation_in_parts(method: str | AlgorithmSpec, hyperparams: Mapping[str, Any] | None = None) -> None:
    """Two sites' partial updates, aggregated, give the model and loss that every node's update gives
    (within float32 rounding); or `partial_refusal` says why not in a sentence and `partial` raises
    NotImplementedError."""
    spec = _spec(method)
    values = dict(hyperparams or {})
    whole = Federation(spec, values)
    reason = whole.coordinator.partial_refusal()
    if reason is not None:
        _require(len(reason) > 20 and reason[0].islower(), f"{spec.name}: say why in a sentence, not {reason!r}")
        try:
            whole.coordinator.partial([])
        except NotImplementedError:
            return
        raise ContractError(f"{spec.name}: partial_refusal gives a reason but partial does not raise")
    whole.run(1)  # a round first, so that server state (FedAvgM's velocity) is not zero
    payload = whole.coordinator.configure_round(context(1, whole.node_ids))
    if not isinstance(payload, Payload):  # a method that sends each node its own payload cannot be split in parts
        raise ContractError(f"{spec.name}: partial means need one payload for all, not {type(payload).__name__}")
    updates = [whole.train(node, payload) for node in whole.node_ids]
    parted = Federation(spec, values)
    parted.run(1)
    partials = []
    for site, members in enumerate((updates[:2], updates[2:])):
        merged, samples = parted.coordinator.partial(members)
        _require(samples == sum(u.num_samples for u in members), f"{spec.name}: a partial claims {samples} samples")
        partials.append(NodeUpdate(node_id=f"site-{site}", round=1, num_samples=samples, payload=merged))
    flat = whole.coordinator.aggregate(context(1, whole.node_ids), updates, [])
    tiered = parted.coordinator.aggregate(context(1, ("site-0", "site-1")), partials, [])
    _require(
        math.isclose(flat["train_loss"], tiered["train_loss"], rel_tol=1e-6),
        f"{spec.name}: the loss aggregated in parts differs",
    )
    a, b = whole.coordinator.model.state_dict(), parted.coordinator.model.state_dict()
    _require(
        all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a),
        f"{spec.name}: the model aggregated in parts differs from the whole's",
    )


def check_fingerprint(method: str | AlgorithmSpec, hyperparams: Mapping[str, Any] | None = None) -> None:
    """The coordinator half and the node half, built from the same hyperparameters, give one fingerprint
    (what a node must match to be given tasks)."""
    spec = _spec(method)
    values = build_hyperparams(spec, dict(hyperparams or {}))
    coordinator = spec.coordinator(values, model=tiny_model(0))
    schema = schema_of(coordinator.model.state_dict())
    mine, node = fingerprint_of(coordinator, schema), fingerprint_of(spec.node(values, node_id="n"), schema)
    _require(
        mine.digest == node.digest,
        f"{spec.name}: the halves' fingerprints differ ({mine.differences(node, 'coordinator', 'node')})",
    )


# -- models ----------------------------------------------------------------------------------------


def check_model(name: str, input_shape: tuple[int, ...], num_classes: int, **options: object) -> None:
    """Model `name` (e.g. "my_package.nets:MyNet") for `input_shape` and `num_classes`: an nn.Module whose
    forward pass gives finite (B, num_classes) logits, whose every parameter gets a gradient, and whose
    initial weights are a function of the seed alone."""
    a, b = (build_model(name, input_shape, num_classes, seed=3, **options) for _ in range(2))
    _require(isinstance(a, nn.Module), f"model {name}: build_model gave a {type(a).__name__}")
    _require(
        a.state_dict().keys() == b.state_dict().keys()
        and all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict()),
        f"model {name}: two builds with one seed differ (draw initial weights from torch's generator only)",
    )
    x = torch.rand(2, *input_shape, generator=torch.Generator().manual_seed(0))
    logits = a.train()(x)
    _require(
        isinstance(logits, torch.Tensor) and tuple(logits.shape) == (2, num_classes),
        f"model {name}: a batch of 2 gave {getattr(logits, 'shape', type(logits).__name__)}, not (2, {num_classes})",
    )
    _require(bool(torch.isfinite(logits).all()), f"model {name}: non-finite logits")
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, num_classes - 1])).backward()
    stuck = [k for k, p in a.named_parameters() if p.requires_grad and p.grad is None]
    _require(not stuck, f"model {name}: no gradient reaches {stuck[:5]}")


# -- datasets --------------------------------------------------------------------------------------


def check_dataset(name: str, **options: object) -> Split:
    """Dataset `name` (e.g. "my_package.data:load") under loader `options`: a Split as the built-in
    loaders give (`fedcore.data.check_split`), the same for the same seed, described by its schema.
    Returns the split (without transforms)."""
    split = load_dataset(name, seed=0, augment="none", normalize="none", **options)  # type: ignore[arg-type]
    check_split(split, f"dataset {name!r}")
    again = load_dataset(name, seed=0, augment="none", normalize="none", **options)  # type: ignore[arg-type]
    _require(
        torch.equal(split.train.x, again.train.x) and torch.equal(split.test.y, again.test.y),
        f"dataset {name}: two loads with one seed differ (draw from the seed you are given)",
    )
    schema = dataset_schema(name, **options)
    _require(schema == schema_of_split(split), f"dataset {name}: its schema {schema} does not describe its data")
    return split
