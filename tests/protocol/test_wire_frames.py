"""The wire format does not change: today's builders make the frames recorded before the protocol
module existed (`frames.json`, see `wire_builders.py`), byte for byte."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.protocol.wire_builders import BUILDERS, build

FRAMES = Path(__file__).with_name("frames.json")
RECORDED: dict[str, bytes] = {k: base64.b64decode(v) for k, v in json.loads(FRAMES.read_text()).items()}


def test_every_builder_has_a_recorded_frame() -> None:
    assert set(RECORDED) == set(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_builders_make_the_recorded_frame(name: str, tmp_path: Path) -> None:
    assert build(name, tmp_path) == RECORDED[name]
