"""Which nodes take part in a round: a uniform sample without replacement, seeded by (seed, round)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from fedcore.seeding import stream


@dataclass(frozen=True, slots=True)
class Selection:
    selected: tuple[str, ...]
    target: int
    """Updates (including `already` ones) that close the round early: K."""


def cohort_size(live: int, fraction: float) -> int:
    """K = max(1, floor(C x live)), or 0 when nobody is live."""
    return max(1, math.floor(fraction * live)) if live else 0


def sample(
    live: Sequence[str],
    *,
    fraction: float,
    over_selection: float,
    seed: int,
    round: int,
    attempt: int = 0,
    already: Collection[str] = (),
) -> Selection:
    """The same live set, seed, round and attempt always give the same cohort, whatever the arrival order.

    `already` are nodes whose updates for this round were accepted in an earlier attempt: they count
    towards K and are not asked again.
    """
    k = cohort_size(len(live), fraction)
    pool = sorted(set(live) - set(already))
    need = max(k - len(already), 0)
    n = min(len(pool), math.ceil(need * over_selection))
    rng = stream(seed, "sampler", round, attempt)
    chosen = rng.choice(len(pool), size=n, replace=False).tolist() if n else []
    return Selection(tuple(sorted(pool[i] for i in chosen)), k)
