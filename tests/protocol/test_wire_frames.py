"""The wire format does not change: today's builders make the frames recorded before the protocol
module existed (`frames.json`, see `wire_builders.py`), byte for byte."""

from __future__ import annotations

import base64
import dataclasses
import json
from pathlib import Path

import pytest

from fedmq.broker import decode, encode
from fedmq.fedcore import protocol
from tests.protocol.wire_builders import BUILDERS, build

FRAMES = Path(__file__).with_name("frames.json")
RECORDED: dict[str, bytes] = {k: base64.b64decode(v) for k, v in json.loads(FRAMES.read_text()).items()}


def test_every_builder_has_a_recorded_frame() -> None:
    assert set(RECORDED) == set(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builders_make_the_recorded_frame(name: str, tmp_path: Path) -> None:
    assert build(name, tmp_path) == RECORDED[name]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_recorded_frames_parse_and_rebuild_byte_for_byte(name: str) -> None:
    """Old logs replay: each recorded frame's meta parses, and its value writes the same meta back
    (keys, values, types and order), so the same frame."""
    message = decode(RECORDED[name])
    value = protocol.parse(message.kind, message.meta)
    meta = value.to_meta()
    assert list(meta.items()) == list(message.meta.items())
    assert _types(meta) == _types(message.meta)
    assert bytes(encode(dataclasses.replace(message, meta=meta))) == RECORDED[name]
    assert type(value).from_meta(meta) == value


def _types(value: object) -> object:
    """The shape of a meta value with every leaf replaced by its type (1 and 1.0, or True, differ)."""
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value)
