"""`method.aggregator`: the averaging step of any method, chosen in the experiment file and checked
before any daemon starts (an unknown rule or a bad option is a ConfigError naming the field)."""

from __future__ import annotations

import re

import pytest
import torch

from experiments.config import parse_config
from fedcore.aggregation import weighted_average
from fedcore.algorithms import AGGREGATORS, build_aggregator
from fedcore.errors import ConfigError


def test_the_default_rule_is_the_weighted_mean() -> None:
    """`mean` is the weighted mean the methods used before the hook existed, and takes no options."""
    assert build_aggregator("mean") is weighted_average
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([4.0])}]
    assert torch.equal(build_aggregator("mean")(states, [2.0, 1.0])["w"], torch.tensor([2.0]))
    with pytest.raises(ConfigError, match=re.escape("method.aggregator.options: aggregator 'mean' takes no options")):
        build_aggregator("mean", {"cv_t": 0.3})


def test_unknown_rule_is_a_config_error_listing_the_available_ones() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("method.aggregator.name: unknown aggregator 'median'; available: ")
    ) as err:
        build_aggregator("median")
    assert all(name in str(err.value) for name in AGGREGATORS)


def test_experiment_files_default_to_the_mean_and_reject_unknown_keys() -> None:
    """An experiment without `aggregator` keeps each method's own mean; a typo in the section is an error."""
    cfg = parse_config({"name": "x", "nodes": 2, "rounds": 1, "method": {"name": "fedprox"}})
    assert cfg.method.aggregator.name == "mean" and cfg.method.aggregator.options == {}
    with pytest.raises(ConfigError, match="aggregator"):
        parse_config(
            {"name": "x", "nodes": 2, "rounds": 1, "method": {"name": "fedprox", "aggregator": {"nme": "fedsa"}}}
        )
