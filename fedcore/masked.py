"""What secure aggregation masks and what the coordinator makes of the unmasked sum.

A node masks one vector: its model's change from the global model it was sent, over the floating
entries in the model's order, weighted by n_k / N (its sample count over the participants' announced
total, `SecAggDirectory.weight_total`). Weighting on the node keeps FedAvg's sample weighting although
the coordinator never sees a node's vector: the unmasked sum is sum_k (n_k / N) d_k, and dividing it
by sum_k n_k / N (the counts travel in clear) gives the weighted mean change. Because the weights sum
to at most 1, the sum stays within the clip range whatever the cohort, so 32-bit fixed point holds it.

Integer entries (BatchNorm's batch counts) are not masked: the mean model keeps the global model's.
Only the group "model" is masked: methods whose updates carry other groups are refused at load.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedmq.fedcore.secagg import RoundKey
from fedmq.fedcore.tensors import StateDict, TensorSpec

GROUP = "secagg"
"""The update's only tensor group with secure aggregation: one int32 tensor, the masked vector."""
TENSOR = "masked"


def round_key(federation: str, round: int, attempt: int, model_id: bytes) -> RoundKey:
    """The attempt's key material binding (`fedcore.secagg.RoundKey`): with the attempt's public model
    id, so that a resumed run's attempt (same round and attempt numbers) is another key."""
    return RoundKey(f"{federation}/{model_id.hex()}", round, attempt)


def floating_entries(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The entries a node masks, in the model's order."""
    return [name for name, value in state.items() if value.is_floating_point()]


def vector_length(state: Mapping[str, torch.Tensor]) -> int:
    return sum(state[name].numel() for name in floating_entries(state))


def masked_schema(state: Mapping[str, torch.Tensor]) -> dict[str, dict[str, TensorSpec]]:
    """What an update carries with secure aggregation: the masked vector, mod 2^32 as int32 bits."""
    return {GROUP: {TENSOR: TensorSpec(torch.int32, (vector_length(state),))}}


def weighted_change(trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], weight: float) -> np.ndarray:
    """(trained - base) * weight over the floating entries, as one float64 vector (what a node masks)."""
    parts = [
        (trained[name].detach().to("cpu", torch.float64) - base[name].detach().to("cpu", torch.float64)).reshape(-1)
        for name in floating_entries(base)
    ]
    if not parts:
        return np.zeros(0, dtype=np.float64)
    return (torch.cat(parts) * weight).numpy()


def mean_model(base: Mapping[str, torch.Tensor], total: np.ndarray, weight_sum: float) -> StateDict:
    """The global model plus the weighted mean change: `total` (the unmasked sum of weighted changes)
    over `weight_sum` (the survivors' weights, sum of n_k / N), entry by entry in the base's dtype."""
    if not weight_sum > 0:
        raise ValueError(f"the survivors' weights sum to {weight_sum}, so there is no mean to take")
    change = as_change(base, np.asarray(total, dtype=np.float64) / weight_sum)
    return {
        name: (value.detach().to(torch.float64) + change[name]).to(value.dtype)
        if name in change
        else value.detach().clone()
        for name, value in base.items()
    }


def as_change(base: Mapping[str, torch.Tensor], vector: np.ndarray) -> StateDict:
    """A vector over the floating entries (`floating_entries`) as float64 tensors shaped like `base`'s."""
    flat = torch.from_numpy(np.asarray(vector, dtype=np.float64))
    out: StateDict = {}
    offset = 0
    for name in floating_entries(base):
        n = base[name].numel()
        out[name] = flat[offset : offset + n].reshape(base[name].shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"the unmasked sum has {flat.numel()} entries and the model {offset} floating ones")
    return out


def as_wire(values: np.ndarray) -> torch.Tensor:
    """A uint32 vector as the int32 tensor an update carries (the same bits)."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.uint32).view(np.int32))


def from_wire(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """An update's int32 tensor back as the uint32 vector it carries."""
    array = tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)
    return np.ascontiguousarray(array, dtype=np.int32).view(np.uint32)
