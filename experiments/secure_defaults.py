"""What `fedmq run --secure` changes in an experiment: the averaging rule (issue 31: "decide and
document a safe default aggregator for --secure runs").

A secure federation is one whose nodes are not all trusted with the model: one node's credentials
are enough to send a poisoned update, and with the plain mean a single -1000x update took the
accuracy to 0.10 (issue 31, item 2). The rule chosen is norm clipping with a bound taken from the
round itself (``clip`` with ``max_norm: auto``: three times the median of the round's update norms),
because of the rules fedmq has it is the one that
- bounds what any one node does to the model (its pull is at most three typical updates' worth)
  while fewer than half of a round's updates are hostile;
- leaves an honest round as it was: updates of one size are not clipped, and the rule is then the
  method's weighted mean (up to float rounding), so the paper's results stand; the median and the
  trimmed mean are unweighted and change every non-IID round;
- needs no number the operator cannot know in advance (a fixed max_norm does).
It needs 3 or more updates a round (with fewer, the median is pulled by the update it should bound)
and synchronous rounds (asynchronous folding takes the mean only); otherwise the plain mean stays,
and the run says so. A rule set in the experiment file is always kept.
"""

from __future__ import annotations

import math

from fedmq.experiments.config import AggregatorConfig, ExperimentConfig

SECURE_AGGREGATOR = AggregatorConfig(name="clip", options={"max_norm": "auto"})


def secure_aggregator(cfg: ExperimentConfig) -> tuple[ExperimentConfig, str]:
    """`cfg` with `--secure`'s averaging rule where the experiment leaves the mean, and a sentence saying
    which rule the run uses and why."""
    rule = cfg.method.aggregator.name
    if rule != "mean":
        return cfg, f"averaging: method.aggregator {rule}, as the experiment says"
    if cfg.engine.kind != "sync" or cfg.policy.late_updates == "carry":
        return cfg, (
            "averaging: the plain mean (asynchronous folding takes no other rule); a poisoned update is"
            " bounded by the sample limits and the non-finite check only"
        )
    if cfg.privacy.secure_aggregation is not None:
        return cfg, (
            "averaging: the plain mean (secure aggregation hides each update, so no rule can clip one; a"
            " poisoned update is bounded by the sample limits only)"
        )
    cohort = cfg.hierarchy.sites or max(1, math.floor(cfg.fraction * cfg.nodes + 1e-9))
    if cohort < 3:
        return cfg, (
            f"averaging: the plain mean ({cohort} update(s) a round; norm clipping against the round's median"
            " needs 3 or more)"
        )
    method = cfg.method.model_copy(update={"aggregator": SECURE_AGGREGATOR})
    return cfg.model_copy(update={"method": method}), (
        "averaging: clip, max_norm auto (no update moves the model by more than 3 times the round's median"
        " update norm; set method.aggregator.name: mean for the plain mean)"
    )
