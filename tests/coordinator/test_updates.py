"""Validating an update against its task's version and the algorithm's schema."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmq.broker import Kind, Message
from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.updates import check_base_version, ingest, parse_update
from fedmq.fedcore.tensors import TensorSpec, arrays_sha256, flatten_groups

SCHEMA = {"model": {"w": TensorSpec(torch.float32, (3,)), "h": TensorSpec(torch.float16, (2,))}}


def _message(w: torch.Tensor, h: torch.Tensor, **meta: object) -> Message:
    return Message(
        kind=Kind.UPDATE, federation="f", round=0, sender="n",
        meta={"task": b"t" * 16, "num_samples": 5, **meta}, tensors=flatten_groups({"model": {"w": w, "h": h}}),
    )  # fmt: skip


def test_update_parses_into_a_node_update_with_its_base_version() -> None:
    update = parse_update(
        _message(torch.ones(3), torch.ones(2, dtype=torch.float16)), SCHEMA, version=4, sent_at=1.0, received_at=1.5
    )
    assert (update.node_id, update.num_samples, update.base_version, update.rtt_seconds) == ("n", 5, 4, 0.5)
    assert torch.equal(update.payload.tensors["model"]["w"], torch.ones(3))


@pytest.mark.parametrize(
    ("w", "h", "name"),
    [
        (torch.tensor([1.0, float("nan"), 0.0]), torch.ones(2, dtype=torch.float16), "model/w"),
        (torch.ones(3), torch.tensor([float("inf"), 0.0], dtype=torch.float16), "model/h"),
    ],
)
def test_update_holding_nan_or_inf_is_refused_naming_the_tensor(w: torch.Tensor, h: torch.Tensor, name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_update(_message(w, h), SCHEMA, version=0, sent_at=0.0, received_at=0.0)
    assert info.value.reason == "non-finite" and name in str(info.value)


def test_bfloat16_update_is_checked_for_nan_too() -> None:
    """numpy has no bfloat16 (the wire tags uint16 storage): its check goes through torch."""
    schema = {"model": {"w": TensorSpec(torch.bfloat16, (2,))}}
    bad = Message(
        kind=Kind.UPDATE, federation="f", round=0, sender="n", meta={"num_samples": 1},
        tensors=flatten_groups({"model": {"w": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)}}),
    )  # fmt: skip
    assert bad.tensors["model/w"].dtype == np.dtype("<u2")
    with pytest.raises(ProtocolError, match="non-finite"):
        parse_update(bad, schema, version=0, sent_at=0.0, received_at=0.0)


def test_base_version_must_be_the_tasks() -> None:
    """Absent is accepted unless required (async); another version or a non-integer is wrong-base-version."""
    check_base_version(_message(torch.ones(3), torch.ones(2)), 3)
    for meta, required in [
        ({}, True),
        ({"base_version": 2}, False),
        ({"base_version": "3"}, False),
        ({"base_version": True}, False),
    ]:
        with pytest.raises(ProtocolError) as info:
            check_base_version(_message(torch.ones(3), torch.ones(2), **meta), 3, required=required)
        assert info.value.reason == "wrong-base-version"


def test_an_ingested_update_is_what_the_engine_takes_and_its_refusal_waits_for_the_engine() -> None:
    """Issue 30: the update is read before the engine (`ingest`). The engine takes what was read (here
    deliberately another update's content, to see which it used), and an ingest that failed is raised
    only when the engine reaches the update, with the reason reading it there would give."""
    good = _message(torch.ones(3), torch.ones(2, dtype=torch.float16))
    other = _message(torch.full((3,), 7.0), torch.ones(2, dtype=torch.float16))
    update = parse_update(good, SCHEMA, version=4, sent_at=1.0, received_at=1.5, ingested=ingest(other, SCHEMA))
    assert torch.equal(update.payload.tensors["model"]["w"], torch.full((3,), 7.0))
    bad = _message(torch.tensor([1.0, float("nan"), 0.0]), torch.ones(2, dtype=torch.float16))
    ingested = ingest(bad, SCHEMA)  # no raise here
    assert isinstance(ingested.read, ProtocolError) and ingested.sha256 == arrays_sha256(bad.tensors)
    with pytest.raises(ProtocolError) as read_there:
        parse_update(bad, SCHEMA, version=4, sent_at=0.0, received_at=0.0)
    with pytest.raises(ProtocolError) as read_before:
        parse_update(bad, SCHEMA, version=4, sent_at=0.0, received_at=0.0, ingested=ingested)
    assert (read_before.value.reason, read_before.value.detail) == (read_there.value.reason, read_there.value.detail)
