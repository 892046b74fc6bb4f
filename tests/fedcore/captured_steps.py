"""What a CUDA device replays, run on the CPU: `fedcore.vectorized.run_steps` with every step as its
captured kind, eagerly."""

from __future__ import annotations

from collections.abc import Callable, Hashable


def every_step_whole(
    total: int, load: Callable[[int], None], eager: Callable[[int], None], whole: Callable[[Hashable], None],
    graphs: bool, kind: Callable[[int], Hashable] = lambda s: None, captured: object = None,
) -> None:  # fmt: skip
    """`run_steps` with every step as a captured graph runs it (its kind's first b nodes, masked where
    some have no batch left: `step_kind`), eagerly: what a CUDA device replays, checkable on the CPU."""
    for s in range(total):
        load(s)
        whole(kind(s))
