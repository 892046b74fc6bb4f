"""What the coordinator and its nodes must agree on: the method, its hyperparameters, the model's schema.

Nodes take their method from their own config file, the coordinator from its own; nothing else makes
them agree, and a node started with another ``mu`` would train its own objective and be averaged in
silently. The coordinator puts the digest in every task and its description in its status; a node
announces its own. Either side that sees a difference refuses and says which settings differ.

Hyperparameters that only one side uses (KDIA's teacher store and logging) are listed by the
Hyperparams class in ``LOCAL_FIELDS`` and left out: they may differ between machines.

A built-in method is named by its name: fedmq's version is the machines' to agree on. A user's method
(`fedcore.algorithms.plugins`) also carries ``code``, a digest of its package's source, so a node
with another version of the user's code is refused like one with another ``mu``. A built-in
method's fingerprint is what it was before plug-ins existed (no ``code``), so older peers still match.
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

from fedmq.fedcore.algorithms import ALGORITHMS, plugins
from fedmq.fedcore.algorithms.base import AlgorithmSpec, CoordinatorHalf, NodeHalf
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
    """16 hex digits over all of them: what a task carries."""
    code: str = ""
    """A user method's source digest (`plugins.source_digest`); empty for a built-in method."""

    def describe(self) -> str:
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(self.hyperparams.items()))
        code = f", code {self.code}" if self.code else ""
        return f"{self.method}({settings}) with model schema {self.schema}{code}"[:MAX_DESCRIPTION]

    def to_meta(self) -> dict[str, Any]:
        hyperparams = dict(self.hyperparams)
        meta = {"digest": self.digest, "method": self.method, "hyperparams": hyperparams, "schema": self.schema}
        return {**meta, "code": self.code} if self.code else meta

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
        code = meta.get("code", "")
        if not isinstance(code, str) or len(code) > 64:
            raise ValueError("method.code must be a short string")
        try:
            return _make(method, dict(hyperparams), schema, code)
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
        if self.code != other.code:
            parts.append(
                f"code of {self.method}: {self.code or 'none'} {here}, {other.code or 'none'} {there}"
                " (another version of the method's package: install or copy the same one everywhere)"
            )
        return "; ".join(parts)[:MAX_DESCRIPTION] or "none"


def fingerprint_of(half: CoordinatorHalf | NodeHalf, schema: Mapping[str, TensorSpec]) -> MethodFingerprint:
    """The fingerprint of a built half: its method is the built-in or loaded user method whose
    Hyperparams and half it is, the one whose half is exactly its class first (a user's FedAvg variant
    that subclasses FedAvg's node half is the variant, not FedAvg); a half built outside the registry
    is named by its Hyperparams class."""
    hp = type(half.hp)
    specs = [*ALGORITHMS.values(), *plugins.loaded().values()]
    exact = (type(half),)
    candidates: list[AlgorithmSpec] = [s for s in specs if hp is s.hyperparams and exact[0] in (s.coordinator, s.node)]
    if not candidates:
        candidates = [s for s in specs if hp is s.hyperparams and isinstance(half, s.coordinator | s.node)]
    if len(candidates) == 1:
        name = candidates[0].name
        return method_fingerprint(name, half.hp, schema, code=plugins.code_of(name) or "")
    return method_fingerprint(f"{hp.__module__}.{hp.__qualname__}", half.hp, schema)


def method_fingerprint(
    method: str, hyperparams: Any, schema: Mapping[str, TensorSpec], *, code: str = ""
) -> MethodFingerprint:
    """The fingerprint of `method` run with the frozen Hyperparams `hyperparams` on a model of `schema`
    (`code`: a user method's source digest)."""
    local = set(getattr(type(hyperparams), "LOCAL_FIELDS", ()))
    plain = _plain(hyperparams) if hyperparams is not None else {}
    shared = {k: v for k, v in plain.items() if k not in local} if isinstance(plain, dict) else {"value": plain}
    return _make(method, shared, schema_digest(schema), code)


def schema_digest(schema: Mapping[str, TensorSpec]) -> str:
    lines = "\n".join(f"{name} {spec.dtype!s} {list(spec.shape)}" for name, spec in sorted(schema.items()))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def _make(method: str, hyperparams: dict[str, Any], schema: str, code: str = "") -> MethodFingerprint:
    """The digest over [method, hyperparams, schema], and the code too when there is one (built-in
    methods keep the digest they always had)."""
    parts: list[Any] = [method, hyperparams, schema, code] if code else [method, hyperparams, schema]
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return MethodFingerprint(method, hyperparams, schema, hashlib.sha256(canonical.encode()).hexdigest()[:16], code)


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
