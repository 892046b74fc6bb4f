"""docs/protocol.md's table of meta fields agrees with the protocol's classes (`fedcore.protocol`):
every field a class writes is documented under its kind, and every field name documented there is
one a class writes, or one of the few other names the row explains (values, nested keys, examples)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from fedmq.fedcore import protocol
from fedmq.fedcore.compression import Compression
from fedmq.fedcore.training import TrainSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")

CLASSES: dict[str, tuple[type[protocol.ProtocolMessage], ...]] = {
    "node-status": (protocol.Announcement,),
    "coordinator-status": (protocol.CoordinatorStatus,),
    "task": (protocol.Task,),
    "update": (protocol.Update, protocol.UpdateFailed),
    "receipt": (protocol.Receipt,),
    "secagg-keys": (protocol.SecAggKeys,),
    "secagg-directory": (protocol.SecAggDirectory,),
    "secagg-shares": (protocol.SecAggShares,),
    "secagg-shared": (protocol.SecAggShared,),
    "secagg-unmask": (protocol.SecAggUnmask,),
    "secagg-reveal": (protocol.SecAggReveal,),
}
SETTINGS = {f.name for f in fields(TrainSettings)}
COMPRESSION = set(Compression(mode="int8-block").meta() or {})
OTHER_NAMES: dict[str, set[str]] = {
    "node-status": {"online", "offline"},  # the states
    "coordinator-status": set(),
    "task": SETTINGS
    | {"model", "neighbours", "threshold", "clip", "l2_clip"},  # the training settings; "as in `model`", the kind
    "update": COMPRESSION
    | {"loss", "version", "nodes"},  # compression's keys; a payload's example; the task's field; site's key
    "receipt": set(protocol.RECEIPT_STATUSES),
    **{kind: set() for kind in protocol.MESSAGES if kind.startswith("secagg-")},
}


def _documented() -> dict[str, set[str]]:
    """The names in backquotes in each kind's row of the meta table (rows "`kind` ..." join their kind's)."""
    section = DOC.read_text().split("### Meta fields per kind", 1)[1].split("\n## ", 1)[0]
    names: dict[str, set[str]] = {}
    for line in section.splitlines():
        match = re.match(r"\| `([a-z-]+)`[^|]*\|(.*)\|\s*$", line)
        if match:
            quoted = re.findall(r"`([^`]+)`", match.group(2))
            names.setdefault(match.group(1), set()).update(q for q in quoted if IDENTIFIER.fullmatch(q))
    return names


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_every_field_is_documented(kind: str) -> None:
    written = {key for cls in CLASSES[kind] for key in protocol.wire_keys(cls)}
    assert written - _documented()[kind] == set(), f"{kind}: fields missing from docs/protocol.md"


@pytest.mark.parametrize("kind", sorted(CLASSES))
def test_nothing_documented_that_does_not_exist(kind: str) -> None:
    written = {key for cls in CLASSES[kind] for key in protocol.wire_keys(cls)}
    assert _documented()[kind] - written - OTHER_NAMES[kind] == set(), (
        f"{kind}: docs/protocol.md names fields no class writes"
    )


def test_the_documented_training_settings_are_the_settings() -> None:
    """A task's `settings` are `TrainSettings`: each is named in the task's row."""
    assert SETTINGS - _documented()["task"] == set()


def test_every_kind_with_a_class_has_a_row() -> None:
    assert set(CLASSES) == set(protocol.MESSAGES) and set(CLASSES) <= set(_documented())
