"""What one training step costs, counted rather than timed: its operators and the bytes they move.

A GPU runs the small models of these papers' steps launch-bound (a cost per kernel) or bound by memory
traffic (a cost per byte read or written), seldom by arithmetic. Both are counted here on any device,
the same on every machine, so that a CPU can tell whether a change to a step takes it towards or away
from the bare reference's: a `TorchDispatchMode` sees every operator torch dispatches, below vmap's
batching rules and autograd (so the operators a GPU would launch), and sums the sizes of the tensors
each takes and returns.

The bytes are those the operators' tensors span as their shapes say, each argument read and each result
or argument the operator writes (its schema says which) written: an argument an operator only writes
(`copy_`'s destination) counts as read too, and a broadcast (expanded) tensor counts every element it
shows. So they bound the traffic from above, the same way for every path; what is compared is the ratio.
Views move nothing and are not counted, nor are allocations and `_unsafe_view` (`NO_KERNEL`).

An operator is about one GPU kernel, not exactly: the mode sees the operator the step calls, not what
runs inside it. A convolution with a bias, for one, is one operator here and two kernels on a GPU (torch
adds the bias after cuDNN's convolution), and on a CPU its backward zeroes the bias's gradient first.
Folding the nodes' biases into their grouped convolution cut the MOON CNN's count by four and made its
CPU round slower (2026-11-29): it was left out. A change is judged by its time, the counts say where to
look.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fedmq.experiments.bench.common import Report

MB = 1e6

NO_KERNEL = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
"""Operators that are not views by their schema yet launch no kernel and move no byte: a reshape's view
that autograd does not track as one, and allocations."""

UNSCALED_ONLY = {torch.ops.aten._fused_sgd_.default, torch.ops.aten._fused_sgd_.tensor_lr}
"""Operators whose schema marks the gradients as written, which they write only to unscale them (given a
`grad_scale`, which fedmq never passes): their gradients count as read only."""


@dataclass(frozen=True)
class StepCost:
    """One step's operators (about one GPU kernel each) and the bytes they read and write."""

    ops: int
    bytes: int


class StepCounter(TorchDispatchMode):
    """Counts the operators dispatched inside it, views and `NO_KERNEL` aside, and the bytes of their tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not func.is_view and func not in NO_KERNEL:
            self.ops += 1
            self.bytes += _moved(
                func._schema, args, kwargs, out, read_only={"grads"} if func in UNSCALED_ONLY else set()
            )
        return out

    @property
    def cost(self) -> StepCost:
        return StepCost(self.ops, self.bytes)


def _moved(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, read_only: set[str]) -> int:
    """Every tensor argument read, then written: those the schema marks as written (in place, `out=`) but
    `read_only`, and the results that alias no argument. So `add_` and the multi-tensor `_foreach_add_`
    (which returns nothing) count alike."""
    given = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
    written = [
        given.get(a.name)
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write and a.name not in read_only
    ]
    results = out if isinstance(out, tuple) else (out,)
    fresh = [r for r, spec in zip(results, schema.returns, strict=False) if spec.alias_info is None]
    return sum(_bytes(t) for t in pytree.tree_leaves((args, kwargs, written, fresh)))


def _bytes(t: object) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def counted(step: Callable[[], object]) -> StepCost:
    """What `step()` dispatches."""
    with StepCounter() as counter:
        step()
    return counter.cost


@contextlib.contextmanager
def last_steps_counted(module: Any, costs: list[StepCost]) -> Iterator[None]:
    """`module.run_steps` (the vectorised trainer's or KDIA generator's step loop) runs its steps eagerly,
    the last step of each call counted into `costs`: a captured step replays the same kernels, and with
    equal shards every node trains at the last step. The steps are those a GPU runs on any device: an
    objective's frozen outputs (a teacher's) made before them (`round_plan.OUTPUTS_AHEAD` on; on a CPU
    `fedmq simulate` makes them in each step, as the counts before 2026-11-29 did)."""
    from fedmq.fedcore.round_plan import outputs_ahead

    def steps(total: int, load: Callable[[int], None], eager: Callable[[int], None], *_: Any, **__: Any) -> None:
        for s in range(total):
            if s < total - 1:
                load(s)
                eager(s)
                continue
            with StepCounter() as counter:
                load(s)
                eager(s)
            costs.append(counter.cost)

    with mock.patch.object(module, "run_steps", steps), outputs_ahead("on"):
        yield


def last_step_cost(call: Callable[[], object], module: Any = None) -> StepCost:
    """The cost of the last step of `call`'s last vectorised round, the copy of its slice of the plan into
    place included; `module`: whose `run_steps` runs the round (`fedcore.vectorized`'s by default)."""
    from fedmq.fedcore import vectorized

    costs: list[StepCost] = []
    with last_steps_counted(vectorized if module is None else module, costs):
        call()
    if not costs:
        raise RuntimeError("the call trained no vectorised round: nothing to count")
    return costs[-1]


def add_cost_rows(
    report: Report,
    costs: dict[str, StepCost],
    reference: str,
    section: str,
    whose: str = "the reference's",
    ops_note: str = "",
) -> None:
    """Each path's operators a step, then its memory traffic a step, each against `reference`'s (`whose`,
    as the ratio's meaning names it)."""
    for name, cost in costs.items():
        report.add(f"{name}: operators a step", cost.ops, "ops", ratio=costs[reference].ops / cost.ops,
                   ratio_means=f"{whose} count (fewer is faster)",
                   note="dispatched, views aside: about one GPU kernel each" + ops_note, section=section)  # fmt: skip
    for name, cost in costs.items():
        report.add(f"{name}: memory traffic a step", cost.bytes / MB, "MB", ratio=costs[reference].bytes / cost.bytes,
                   ratio_means=f"{whose} traffic (less is faster where memory bounds a step)",
                   note="the bytes of every operator's tensors, read and written, as their shapes say: an upper"
                   " bound, counted alike for every path", section=section)  # fmt: skip
