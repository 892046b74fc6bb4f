"""Per-step tensors packed into one row of bytes per step, so that a step loads its slice with one copy.

A vectorised round (`fedcore.vectorized`) reads, at each of its S steps, that step's slice of several
plan tensors (the batch's rows, the padding's weights, the real-sample counts, the augmentation's
drawn values, an objective's drawn inputs). Copied one tensor at a time into the static buffers a
captured CUDA graph reads, each slice is one more kernel per step, and on the launch-bound models of
the papers a kernel is what a step costs. Here the S slices of every tensor lie side by side in one
(S, bytes) uint8 tensor, each tensor a typed view of its columns, so that loading step s is one copy
of row s into a (bytes,) buffer whose typed views are the step's tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ALIGN = 16
"""Each field starts at a multiple of this many bytes: a typed view needs its offset (and the row's
length) divisible by its element size, and 16 covers every dtype torch has."""


@dataclass(frozen=True, slots=True)
class Field:
    """Where one tensor's slice of a step lies in the step's bytes."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The slice's shape (one step's)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Packed:
    """S steps of named tensors, row s of `rows` holding step s of each (`view` gives them back)."""

    rows: torch.Tensor
    """(S, bytes) uint8."""
    layout: dict[str, Field]

    @classmethod
    def of(
        cls,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device,
        pinned: bool = False,
        room: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> Packed:
        """`tensors` (each (S, ...), any dtype and device) packed on `device`: on the host first when all
        are there, then moved in one transfer (one copy from the host per tensor costs a transfer each);
        `pinned`, from page-locked memory without the host waiting for the device's queued work. `room`:
        fields (each step's shape, dtype) left unwritten after the tensors', made on `device` only (what
        the device fills in later: nothing of them is staged or sent)."""
        steps = {len(t) for t in tensors.values()}
        if len(steps) != 1:
            raise ValueError(f"tensors of {sorted(steps)} steps: every tensor needs the same number")
        layout: dict[str, Field] = {}
        offset = 0

        def lay_out(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
            nonlocal offset
            layout[name] = field = Field(offset, dtype, shape)
            offset += -(-field.nbytes // ALIGN) * ALIGN

        for name, t in tensors.items():
            lay_out(name, t.dtype, tuple(t.shape[1:]))
        given = offset  # the tensors' bytes, which are staged and sent
        for name, (shape, dtype) in (room or {}).items():
            lay_out(name, dtype, tuple(shape))
        cpu = torch.device("cpu")
        home = cpu if all(t.device == cpu for t in tensors.values()) else device
        staged_pinned = pinned and home == cpu and device != cpu  # staged where the copy can leave from at once
        s = steps.pop()
        rows = torch.empty((s, max(given, ALIGN)), dtype=torch.uint8, device=home, pin_memory=staged_pinned)
        staged = cls(rows, layout)
        for name, t in tensors.items():
            staged.view(rows, name).copy_(t)
        sent = rows if home == device else send(rows, device, staged_pinned)
        if not room:
            return cls(sent, layout)
        whole = torch.empty((s, max(offset, ALIGN)), dtype=torch.uint8, device=device)
        whole[:, :given].copy_(sent[:, :given])
        return cls(whole, layout)

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """Field `name` of `buffer`, typed and shaped: of every step for `rows` ((S, ...)), of one step
        for a (bytes,) row or a copy of one ((...)). A view: writing it writes `buffer`."""
        field = self.layout[name]
        part = buffer[..., field.offset : field.offset + field.nbytes]
        return part.view(field.dtype).view(*buffer.shape[:-1], *field.shape)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: self.view(buffer, name) for name in self.layout}


def send(t: torch.Tensor, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """`t` on `device`; with `pinned`, from page-locked memory without the host waiting (a plain copy from
    pageable memory waits for the device's queued work first). `t` may be page-locked already."""
    if pinned and t.device.type == "cpu" and device.type != "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)
