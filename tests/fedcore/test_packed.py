"""`fedcore.packed`: per-step tensors of several dtypes and shapes as typed views of one byte row per step."""

from __future__ import annotations

import pytest
import torch

from fedmq.fedcore.packed import ALIGN, Packed


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "rows": torch.randint(0, 10**9, (5, 3, 7), generator=g),  # int64
        "weight": torch.rand((5, 3, 7), generator=g),  # float32
        "count": torch.rand((5, 3), generator=g, dtype=torch.float64),
        "flip": torch.rand((5, 3, 7), generator=g) < 0.5,  # bool: 21 bytes a step, padded
        "features": torch.randn((5, 3, 7, 2), generator=g).half(),
    }


def test_each_field_is_its_tensor_bitwise_typed_and_shaped() -> None:
    given = tensors()
    packed = Packed.of(given, torch.device("cpu"))
    assert packed.rows.dtype == torch.uint8 and packed.rows.shape[0] == 5
    assert packed.rows.shape[1] % ALIGN == 0
    for name, t in given.items():
        view = packed.view(packed.rows, name)
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t), name


def test_one_copy_of_a_row_loads_every_fields_step() -> None:
    """What a vectorised step's `load` does: the buffer's views, made once, then hold step s of each field."""
    given = tensors()
    packed = Packed.of(given, torch.device("cpu"))
    buffer = packed.rows[0].clone()
    views = packed.views(buffer)
    for s in (3, 1, 4):
        buffer.copy_(packed.rows[s])
        for name, t in given.items():
            assert torch.equal(views[name], t[s]), (name, s)


def test_writing_a_view_writes_the_rows() -> None:
    packed = Packed.of(tensors(), torch.device("cpu"))
    packed.view(packed.rows, "weight")[2, 1, 0] = 0.25
    assert float(packed.view(packed.rows[2], "weight")[1, 0]) == 0.25


def test_tensors_of_different_step_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="same number"):
        Packed.of({"a": torch.zeros(4, 2), "b": torch.zeros(5, 2)}, torch.device("cpu"))


def test_room_is_laid_out_after_the_tensors_and_neither_staged_nor_sent() -> None:
    """Fields of `room` (a teacher's outputs, which the device fills in later) follow the tensors' in each
    row, typed and shaped; the tensors' fields hold their tensors as without room, and the room writes."""
    given = tensors()
    packed = Packed.of(given, torch.device("cpu"), room={"teacher": ((3, 7, 10), torch.float32)})
    plain = Packed.of(given, torch.device("cpu"))
    assert packed.layout["teacher"].offset >= plain.rows.shape[1] and packed.rows.shape[1] % ALIGN == 0
    for name, t in given.items():
        assert packed.layout[name] == plain.layout[name] and torch.equal(packed.view(packed.rows, name), t)
    room = packed.view(packed.rows, "teacher")
    assert room.shape == (5, 3, 7, 10) and room.dtype == torch.float32
    room.copy_(torch.arange(room.numel(), dtype=torch.float32).view(room.shape))
    assert float(packed.view(packed.rows[4], "teacher")[2, 6, 9]) == room.numel() - 1
    assert all(torch.equal(packed.view(packed.rows, name), t) for name, t in given.items())
