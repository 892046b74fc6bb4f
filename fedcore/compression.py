"""Lossy compression of update tensors for thin links: float16, bfloat16 and 8-bit quantisation.

A node compresses the flat ``group/name -> array`` mapping it is about to send (`compress`) and says
how in its update's meta (`Compression.meta`); the coordinator restores every tensor to the dtype
and shape its schema expects (`decompress`) before it checks the update. Modes:

``float16``, ``bfloat16``
    Each float32 or float64 tensor travels as that 16-bit float (round to nearest even): half the
    bytes. float16 keeps 11 significant bits but overflows above 65504 (the coordinator then refuses
    the update as non-finite); bfloat16 keeps float32's range with 8 significant bits.
``int8``
    Each floating tensor travels as int8 with one float32 scale: ``x ~ scale * q``, ``q`` in
    [-127, 127], ``scale = max|x| / 127`` (symmetric, round to nearest). A quarter of float32's bytes.
``int8-block``
    The same with one scale per `Compression.block` consecutive elements (C order; a tensor's last
    block may be shorter): an outlier costs the precision of its block only, for 4 bytes of scale
    per block.

With `Compression.delta` (the default) the compressed tensors of the ``model`` group are the
differences from the model the node's task carried, not the weights themselves: the coordinator
keeps that model (`coordinator.storage.versions`) and adds it back (`add_base`). A difference is one local
training's worth of change, far smaller than the weights, so the same bits describe it about ten
times more finely (docs/compression.md measures it); the weights' own quantisation error would not
shrink as training converges and updates do.

Only floating tensors are compressed (16-bit modes: only those wider than 16 bits); integer
buffers travel as they are. The int8 modes' scales travel as one float32 tensor named `SCALES`,
the scales of each compressed tensor one after another, the tensors in the order of their names.

Nothing here trusts the wire: `decompress` checks each tensor's storage dtype and shape against the
schema, the scales' dtype, count and finiteness, and raises `CompressionError` naming what is wrong.
The error after decompression is bounded: half a step of the 16-bit format's mantissa, or half a
scale (``max|x| / 254`` of the tensor or block) for int8.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import numpy as np
import torch

from fedmq.fedcore.errors import ConfigError, check_section
from fedmq.fedcore.tensors import BFLOAT16, StateDict, TensorSpec, flatten_groups, from_numpy, to_numpy
from fedmq.fields import Bounds

Mode = Literal["none", "float16", "bfloat16", "int8", "int8-block"]
MODES: tuple[str, ...] = get_args(Mode)

DELTA_GROUP = "model"
"""With `Compression.delta`, this group's compressed tensors are differences from the task's model."""

SCALES = "_compression/scales"
"""The int8 modes' scales: one float32 vector, not a tensor of any group the schema knows."""

DEFAULT_BLOCK = 256
MIN_BLOCK = 8
MAX_BLOCK = 1 << 24
BLOCK = Bounds(ge=MIN_BLOCK, le=MAX_BLOCK)
"""The bounds of `Compression.block`."""

_META_KEYS = frozenset({"mode", "block", "delta"})


class CompressionError(ValueError):
    """A compressed update that cannot be decoded; the message says what is wrong."""

    reason = "bad-compression"


@dataclass(frozen=True, kw_only=True, slots=True)
class Compression:
    """How a node compresses its updates (and how the coordinator reads one back)."""

    mode: Mode = "none"
    """none | float16 | bfloat16 (half the bytes) | int8 (a quarter: one scale per tensor) | int8-block (one
    scale per block of elements)"""
    block: Annotated[int, BLOCK] = DEFAULT_BLOCK
    """elements per scale for int8-block (4 bytes each)"""
    # ignored by the other modes
    delta: bool = True
    """compress the model's change from the model the task carried (finer; the coordinator keeps that model)
    rather than the weights themselves"""
    # False: nothing kept at the coordinator, and a coarser update

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or not BLOCK.allows(self.block):
            raise ConfigError(  # in these words: a malformed update's refusal carries them (its detail)
                f"block {self.block!r} must be a whole number from {MIN_BLOCK} to {MAX_BLOCK}",
                field="compression.block",
            )
        if not isinstance(self.delta, bool):
            raise ConfigError(f"delta {self.delta!r} must be true or false", field="compression.delta")
        check_section(self, "compression")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def quantised(self) -> bool:
        return self.mode in ("int8", "int8-block")

    def meta(self) -> dict[str, Any] | None:
        """What the update's meta says under ``compression``: None (nothing) for ``none``. Two
        compressions that write the same meta are the same on the wire."""
        if not self.enabled:
            return None
        meta: dict[str, Any] = {"mode": self.mode, "delta": self.delta}
        return (meta | {"block": self.block}) if self.mode == "int8-block" else meta

    @classmethod
    def from_meta(cls, value: object) -> Compression:
        """The compression an update's meta announces (None: the update is not compressed)."""
        if value is None:
            return cls()
        if not isinstance(value, dict) or not set(value) <= _META_KEYS or not {"mode", "delta"} <= set(value):
            raise CompressionError(f"compression meta {value!r} is not a map of mode, delta (and block)")
        mode = value["mode"]
        if mode not in MODES or mode == "none":
            raise CompressionError(f"unknown compression mode {mode!r}; supported: {', '.join(MODES[1:])}")
        if ("block" in value) != (mode == "int8-block"):
            raise CompressionError(f"block is given with int8-block and only then (mode {mode!r})")
        try:
            return cls(mode=mode, block=value.get("block", DEFAULT_BLOCK), delta=value["delta"])
        except ConfigError as exc:
            raise CompressionError(str(exc)) from None

    def describe(self) -> str:
        """``int8-block(256, delta)``, for logs and refusals."""
        if not self.enabled:
            return "uncompressed"
        args = [str(self.block)] if self.mode == "int8-block" else []
        return f"{self.mode}({', '.join([*args, 'delta' if self.delta else 'weights'])})"

    def scale_count(self, size: int) -> int:
        """Scales of a compressed tensor of `size` elements."""
        return 1 if self.mode == "int8" else -(-size // self.block)

    def compresses(self, floating: bool, itemsize: int) -> bool:
        """Whether a tensor of this kind is compressed (the rule both ends apply)."""
        if not floating or self.mode == "none":
            return False
        return itemsize > 2 if self.mode in ("float16", "bfloat16") else True


def _floating(array: np.ndarray) -> bool:
    return array.dtype.kind == "f" or bool(array.dtype.metadata and array.dtype.metadata.get("fedmq_dtype"))


def _as_float(array: np.ndarray) -> np.ndarray:
    """The values as float64 (for float64 tensors) or float32 (anything narrower)."""
    if array.dtype.metadata and array.dtype.metadata.get("fedmq_dtype") == "bfloat16":
        return from_numpy(array).float().numpy()
    return array.astype(np.float64 if array.dtype.itemsize == 8 else np.float32, copy=False)


def _cast(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Float32/64 values as the numpy array the bus would carry for `dtype` (a floating dtype)."""
    if dtype == torch.bfloat16:
        return to_numpy(torch.from_numpy(np.require(values, requirements="C")).to(torch.bfloat16))
    target = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16}[dtype]
    with np.errstate(over="ignore"):  # an overflow to inf is refused later as non-finite
        return values.astype(target, copy=False)


def _quantise(values: np.ndarray, per: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes, float32 scales) of `values`, one scale for all (`per` None) or per `per` elements."""
    flat = values.reshape(-1)
    if per is None:
        rows = flat.reshape(1, -1)
    else:
        count = -(-flat.size // per)
        rows = np.zeros((count, per), dtype=flat.dtype)
        rows.reshape(-1)[: flat.size] = flat
    if rows.size == 0:
        return np.zeros(values.shape, np.int8), np.zeros(len(rows), np.float32)
    scales = (np.abs(rows).max(axis=1) / 127).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.rint(rows / scales[:, None].astype(rows.dtype))
    codes[~np.isfinite(codes)] = 0  # a zero scale (all zeros), or a non-finite one the coordinator refuses
    codes = np.clip(codes, -127, 127).astype(np.int8).reshape(-1)[: flat.size]
    return codes.reshape(values.shape), scales


def _dequantise(codes: np.ndarray, scales: np.ndarray, per: int | None, wide: bool) -> np.ndarray:
    work: type[np.floating[Any]] = np.float64 if wide else np.float32
    flat = codes.reshape(-1).astype(work)
    if per is None:
        return (flat * work(scales[0])).reshape(codes.shape)
    out = np.empty(len(scales) * per, dtype=work)
    out[: flat.size] = flat
    out[flat.size :] = 0  # the last block's padding: uninitialised memory may hold NaN, which warns in the multiply
    rows = out.reshape(len(scales), per)
    rows *= scales[:, None].astype(work)
    return out[: flat.size].reshape(codes.shape)


def compress(
    arrays: Mapping[str, np.ndarray], compression: Compression, *, base: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """The arrays to send under `compression` (new arrays; integer tensors are passed through).
    With `compression.delta`, `base` holds the task's ``model`` group (flat names) to subtract."""
    if not compression.enabled:
        return dict(arrays)
    if SCALES in arrays:
        raise ValueError(f"{SCALES} is reserved for the compression's scales")
    values: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if compression.compresses(_floating(array), array.dtype.itemsize):
            values[name] = _as_float(array)
            if compression.delta and name.startswith(DELTA_GROUP + "/"):
                values[name] = np.asarray(values[name] - _as_float(_base_of(name, array, base)))
    out: dict[str, np.ndarray] = {}
    for name, array in arrays.items():
        if name not in values:
            out[name] = array
        elif compression.mode == "float16":
            with np.errstate(over="ignore"):  # refused as non-finite by the coordinator
                out[name] = values[name].astype(np.float16)
        elif compression.mode == "bfloat16":
            out[name] = _cast(values[name], torch.bfloat16)
    if compression.quantised:
        per = compression.block if compression.mode == "int8-block" else None
        scales = []
        for name in sorted(values):
            out[name], scale = _quantise(values[name], per)
            scales.append(scale)
        out = {name: out[name] for name in arrays}  # the caller's order
        out[SCALES] = np.concatenate(scales) if scales else np.zeros(0, np.float32)
    return out


def _base_of(name: str, array: np.ndarray, base: Mapping[str, np.ndarray] | None) -> np.ndarray:
    found = base.get(name) if base is not None else None
    if found is None or found.shape != array.shape:
        raise ValueError(
            f"delta compression needs the task's model for {name}; a method whose task carries none (or"
            " another one) needs compression.delta false"
        )
    return found


def compress_update(
    arrays: Mapping[str, np.ndarray], compression: Compression, received: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, np.ndarray]:
    """A node's update (flat arrays) as the bus carries it, given the tensor groups its task carried
    (the ``model`` group is the base of a delta)."""
    if not compression.enabled:
        return dict(arrays)
    model = received.get(DELTA_GROUP) if compression.delta else None
    return compress(arrays, compression, base=flatten_groups({DELTA_GROUP: model}) if model is not None else None)


def decompress(
    arrays: Mapping[str, np.ndarray], compression: Compression, schema: Mapping[str, TensorSpec]
) -> dict[str, np.ndarray]:
    """The update's arrays as the schema (flat names) expects them; `CompressionError` says what is
    wrong. A tensor the schema does not know is passed through for the schema check to refuse.
    With `compression.delta` the ``model`` group's compressed tensors are still differences: `add_base`."""
    if not compression.enabled:
        if SCALES in arrays:
            raise CompressionError(f"{SCALES} in an update that is not quantised")
        return dict(arrays)
    names = sorted(n for n in arrays if n != SCALES)
    wanted = [n for n in names if n in schema and _compresses_spec(compression, schema[n])]
    per = compression.block if compression.mode == "int8-block" else None
    storage = {"float16": np.dtype("<f2"), "bfloat16": BFLOAT16}.get(compression.mode, np.dtype("i1"))
    for name in wanted:
        array, spec = arrays[name], schema[name]
        if array.dtype != storage or array.dtype.metadata != storage.metadata:
            raise CompressionError(
                f"{name} is {_name(array.dtype)}, a {compression.mode} update carries {_name(storage)}"
            )
        if tuple(array.shape) != spec.shape:
            raise CompressionError(f"{name} has shape {tuple(array.shape)}, expected {spec.shape}")
    scales = _scales(arrays, compression, wanted)
    out: dict[str, np.ndarray] = {}
    offset = 0
    for name in wanted:
        array, spec = arrays[name], schema[name]
        if scales is None:
            values = from_numpy(array).float().numpy() if storage is BFLOAT16 else array.astype(np.float32)
        else:
            count = compression.scale_count(array.size)
            values = _dequantise(array, scales[offset : offset + count], per, spec.dtype == torch.float64)
            offset += count
        out[name] = _cast(values, spec.dtype)
    return {name: out.get(name, arrays[name]) for name in arrays if name != SCALES}


def _compresses_spec(compression: Compression, spec: TensorSpec) -> bool:
    return compression.compresses(spec.dtype.is_floating_point, spec.dtype.itemsize)


def _name(dtype: np.dtype[Any]) -> str:
    return "bfloat16" if dtype.metadata and dtype.metadata.get("fedmq_dtype") else dtype.name


def _scales(arrays: Mapping[str, np.ndarray], compression: Compression, wanted: list[str]) -> np.ndarray | None:
    """The scales vector, checked: present for the int8 modes only, float32, 1-D, finite, >= 0, and
    exactly as many as the compressed tensors need."""
    scales = arrays.get(SCALES)
    if not compression.quantised:
        if scales is not None:
            raise CompressionError(f"{SCALES} in a {compression.mode} update")
        return None
    if scales is None:
        raise CompressionError(f"a {compression.mode} update without {SCALES}")
    if scales.dtype != np.dtype("<f4") or scales.dtype.metadata or scales.ndim != 1:
        raise CompressionError(f"{SCALES} must be a float32 vector, got {_name(scales.dtype)} {scales.shape}")
    needed = sum(compression.scale_count(arrays[n].size) for n in wanted)
    if scales.size != needed:
        raise CompressionError(f"{scales.size} scales for tensors that need {needed}")
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise CompressionError("the scales must be finite and non-negative")
    return scales


def add_base(
    delta: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], compression: Compression
) -> StateDict:
    """The ``model`` group of a delta-compressed update with the task's model added back: base +
    difference for the tensors that were compressed (in float32, or float64 for float64 tensors),
    the others (integer buffers, 16-bit floats of the 16-bit modes) as they came."""
    out: StateDict = {}
    for name, tensor in delta.items():
        if not (compression.delta and compression.compresses(tensor.is_floating_point(), tensor.element_size())):
            out[name] = tensor
            continue
        work = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        origin = base.get(name)
        if origin is None or origin.shape != tensor.shape:
            raise ValueError(f"the base model has no tensor {name} of shape {tuple(tensor.shape)}")
        out[name] = (origin.to("cpu", work) + tensor.to(work)).to(tensor.dtype)
    return out
