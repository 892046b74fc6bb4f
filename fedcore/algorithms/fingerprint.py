"""What the coordinator and its nodes must agree on: the method, its hyperparameters, the model's schema.

Nodes take their method from their own config file, the coordinator from its own; nothing else makes
them agree, and a node started with another ``mu`` would train its own objective and be averaged in
silently. The coordinator puts the digest in every task and its description in its status; a node
announces its own. Either side that sees a difference refuses and says which settings differ.

Hyperparameters that only one side uses (KDIA's teacher store and logging) are listed by the
Hyperparams class in ``LOCAL_FIELDS`` and left out: they may differ between machines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from fedmq.fedcore.algorithms import ALGORITHMS
from fedmq.fedcore.algorithms.base import CoordinatorHalf, NodeHalf
from fedmq.fedcore.tensors import TensorSpec

MAX_DESCRIPTION = 500
"""Characters of a description put in a log line or a refusal (a peer's description is untrusted)."""


@dataclass(frozen=True, slots=True)
class MethodFingerprint:
    method: str
    hyperparams: Mapping[str, Any]
    """The shared hyperparameters, JSON-able (tuples as lists, paths as strings)."""
    schema: str
    """A digest of the model's tensors: names, dtypes and shapes."""
    digest: str
    """16 hex digits over all three: what a task carries."""

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(self.hyperparams.items()))
        return f"{self.method}({settings}) with model schema {self.schema}"[:MAX_DESCRIPTION]

    def to_meta(self) -> dict[str, Any]:
        hyperparams = dict(self.hyperparams)
        return {"digest": self.digest, "method": self.method, "hyperparams": hyperparams, "schema": self.schema}

    @classmethod
    def from_meta(cls, meta: Any) -> MethodFingerprint:
        """A peer's announced fingerprint; ValueError says what is malformed. The digest is recomputed,
        so a peer cannot announce one description and match with another."""
        if not isinstance(meta, Mapping):
            raise ValueError("method must be a map")
        method, hyperparams, schema = meta.get("method"), meta.get("hyperparams"), meta.get("schema")
        if not isinstance(method, str) or not 0 < len(method) <= 200:
            raise ValueError("method.method must be a short string")
        if not isinstance(schema, str) or len(schema) > 64:
            raise ValueError("method.schema must be a short string")
        if not isinstance(hyperparams, Mapping) or not all(isinstance(k, str) for k in hyperparams):
            raise ValueError("method.hyperparams must be a map with string keys")
        try:
            return _make(method, dict(hyperparams), schema)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"method.hyperparams is not plain data: {exc}") from None

    def differences(self, other: MethodFingerprint, here: str = "here", there: str = "there") -> str:
        """Which settings differ, as one line: 'mu: 0.01 here, 0.1 there; model schema ...'."""
        if self.method != other.method:
            return f"method: {self.method} {here}, {other.method} {there}"
        parts = []
        for key in sorted(set(self.hyperparams) | set(other.hyperparams)):
            mine, theirs = self.hyperparams.get(key, "unset"), other.hyperparams.get(key, "unset")
            if mine != theirs:
                parts.append(f"{key}: {mine!r} {here}, {theirs!r} {there}")
        if self.schema != other.schema:
            parts.append(f"model schema: {self.schema} {here}, {other.schema} {there} (another model or dataset)")
        return "; ".join(parts)[:MAX_DESCRIPTION] or "none"


def fingerprint_of(half: CoordinatorHalf | NodeHalf, schema: Mapping[str, TensorSpec]) -> MethodFingerprint:
    """The fingerprint of a built half: its method is the registered one whose Hyperparams and half it
    is (a half built outside the registry is named by its Hyperparams class)."""
    hp = type(half.hp)
    names = [
        spec.name
        for spec in ALGORITHMS.values()
        if hp is spec.hyperparams and isinstance(half, spec.coordinator | spec.node)
    ]
    name = names[0] if len(names) == 1 else f"{hp.__module__}.{hp.__qualname__}"
    return method_fingerprint(name, half.hp, schema)


def method_fingerprint(method: str, hyperparams: Any, schema: Mapping[str, TensorSpec]) -> MethodFingerprint:
    """The fingerprint of `method` run with the frozen Hyperparams `hyperparams` on a model of `schema`."""
    local = set(getattr(type(hyperparams), "LOCAL_FIELDS", ()))
    plain = _plain(hyperparams) if hyperparams is not None else {}
    shared = {k: v for k, v in plain.items() if k not in local} if isinstance(plain, dict) else {"value": plain}
    return _make(method, shared, schema_digest(schema))


def schema_digest(schema: Mapping[str, TensorSpec]) -> str:
    lines = "\n".join(f"{name} {spec.dtype!s} {list(spec.shape)}" for name, spec in sorted(schema.items()))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def _make(method: str, hyperparams: dict[str, Any], schema: str) -> MethodFingerprint:
    canonical = json.dumps([method, hyperparams, schema], sort_keys=True, separators=(",", ":"), allow_nan=True)
    return MethodFingerprint(method, hyperparams, schema, hashlib.sha256(canonical.encode()).hexdigest()[:16])


def _plain(value: Any) -> Any:
    """`value` as JSON-able data that survives msgpack unchanged (tuples become lists)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)
