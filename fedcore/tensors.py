"""Torch state dicts to and from the bus's numpy arrays, without copies where torch allows.

Wire names are ``group/name`` (for example ``model/fc.weight``), so that one message can carry
several models (KDIA sends the student, the teacher and the generator).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from fedmq.fedcore.errors import AlgorithmError

StateDict = dict[str, torch.Tensor]

#: numpy has no bfloat16; the bus tags uint16 storage with this dtype (same as broker.codec.BFLOAT16,
#: rebuilt here because the core does not import the bus).
BFLOAT16 = np.dtype("<u2", metadata={"fedmq_dtype": "bfloat16"})

_TORCH_TO_NUMPY = {
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU numpy view (a copy only when the tensor lives on a GPU)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    if t.dtype not in _TORCH_TO_NUMPY:
        raise TypeError(f"tensor dtype {t.dtype} cannot travel on the bus")
    return t.numpy()


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch view on a (possibly read-only) array from the bus.

    Decoded arrays are views on the received message and read-only; the tensor shares that memory
    and must not be written to (loading it into a model copies it, which is the one needed copy).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        if array.dtype.metadata and array.dtype.metadata.get("fedmq_dtype") == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)


def flatten_groups(groups: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    flat: dict[str, np.ndarray] = {}
    for group, state in groups.items():
        if "/" in group or not group:
            raise ValueError(f"group name {group!r} may not be empty or contain '/'")
        for name, tensor in state.items():
            flat[f"{group}/{name}"] = to_numpy(tensor)
    return flat


def split_groups(arrays: Mapping[str, np.ndarray]) -> dict[str, StateDict]:
    groups: dict[str, StateDict] = {}
    for key, array in arrays.items():
        group, sep, name = key.partition("/")
        if not sep or not name:
            raise AlgorithmError(f"tensor {key!r} is not named 'group/name'")
        groups.setdefault(group, {})[name] = from_numpy(array)
    return groups


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]


def cpu_copy(state: Mapping[str, torch.Tensor]) -> StateDict:
    """A detached copy on the CPU that later training or loading cannot change (stored models)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def schema_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(v.dtype, tuple(v.shape)) for k, v in state.items()}


def schema_mismatch(state: Mapping[str, torch.Tensor], expected: Mapping[str, TensorSpec]) -> tuple[str, str] | None:
    """(reason, detail) of the first way `state` differs from `expected`, or None if it matches."""
    missing = expected.keys() - state.keys()
    if missing:
        return "wrong-shape", f"missing tensors {sorted(missing)[:5]}"
    extra = state.keys() - expected.keys()
    if extra:
        return "wrong-shape", f"unexpected tensors {sorted(extra)[:5]}"
    for name, spec in expected.items():
        tensor = state[name]
        if tensor.dtype != spec.dtype:
            return "wrong-dtype", f"{name} is {tensor.dtype}, expected {spec.dtype}"
        if tuple(tensor.shape) != spec.shape:
            return "wrong-shape", f"{name} has shape {tuple(tensor.shape)}, expected {spec.shape}"
    return None


def non_finite(state: Mapping[str, torch.Tensor]) -> str | None:
    """Name of the first floating tensor holding NaN or inf: such an update would poison the average."""
    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def arrays_sha256(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> str:
    """The hex sha256 of named tensors in a canonical order, so that equal models hash equally
    wherever they live: by name (sorted, as UTF-8 bytes); for each, the name, its dtype as the bus
    names it (``float32``, ``bfloat16``, ...), its shape, then its values as contiguous
    little-endian bytes in C order. Event logs and run summaries quote it (docs/replay.md)."""
    digest = hashlib.sha256()
    for name in sorted(arrays, key=lambda n: n.encode()):
        value = arrays[name]
        array = to_numpy(value) if isinstance(value, torch.Tensor) else np.asarray(value)
        bfloat = bool(array.dtype.metadata and array.dtype.metadata.get("fedmq_dtype") == "bfloat16")
        dtype = "bfloat16" if bfloat else array.dtype.name
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        digest.update(f"{name}\0{dtype}\0{','.join(map(str, array.shape))}\0".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
    return digest.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    """`arrays_sha256` of a model's state dict (parameters and buffers)."""
    return arrays_sha256(model.state_dict())
