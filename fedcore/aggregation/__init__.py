"""Aggregation: every rule that turns client models into one, in one place.

`mean` holds the weighted mean (every averaging method's default) and the asynchronous folding
steps; `robust` the rules that bound a poisoned update. The names below are what the rest of
fedmq imports, so a module that only averages need not know which file a rule lives in.
"""

from __future__ import annotations

from fedmq.fedcore.aggregation.mean import Aggregator, fedasync_step, fedbuff_step, weighted_average

__all__ = ["Aggregator", "fedasync_step", "fedbuff_step", "weighted_average"]
