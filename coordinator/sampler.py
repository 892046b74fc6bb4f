"""Which nodes take part in a round: a uniform sample without replacement, seeded by (seed, round)."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from fedmq.fedcore.seeding import stream


@dataclass(frozen=True, slots=True)
class Selection:
    selected: tuple[str, ...]
    target: int
    """Updates (including `already` ones) that close the round early: K."""


def cohort_size(live: int, fraction: float, *, draw: float | None = None) -> int:
    """K = max(1, floor(C x live)), or 0 when nobody is live. With `draw` (uniform in [0, 1)), the
    fraction's remainder is rounded up with its own probability: floor(C x live) + 1 when draw <
    frac(C x live), so that K is C x live on average (a site's share of a hierarchical round)."""
    if not live:
        return 0
    exact = fraction * live
    k = math.floor(exact)
    if draw is not None and draw < exact - k:
        k += 1
    return max(1, k)


def sample(
    live: Sequence[str],
    *,
    fraction: float,
    over_selection: float,
    seed: int,
    round: int,
    attempt: int = 0,
    already: Collection[str] = (),
    stratum: str | None = None,
) -> Selection:
    """The same live set, seed, round and attempt always give the same cohort, whatever the arrival order.

    `already` are nodes whose updates for this round were accepted in an earlier attempt: they count
    towards K and are not asked again. A `stratum` (a site of a hierarchical federation, which samples
    its own nodes) draws from a stream of its own and rounds C x live up or down at random, so that
    the sites' cohorts add up to C x all live nodes on average, as one flat cohort would.
    """
    rng = (
        stream(seed, "sampler", round, attempt) if stratum is None else stream(seed, "sampler", stratum, round, attempt)
    )
    k = cohort_size(len(live), fraction, draw=None if stratum is None else float(rng.random()))
    pool = sorted(set(live) - set(already))
    need = max(k - len(already), 0)
    n = min(len(pool), math.ceil(need * over_selection))
    chosen = rng.choice(len(pool), size=n, replace=False).tolist() if n else []
    return Selection(tuple(sorted(pool[i] for i in chosen)), k)
