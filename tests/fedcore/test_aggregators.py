"""`method.aggregator`: the averaging step of any method, chosen in the experiment file and checked
before any daemon starts (an unknown rule or a bad option is a ConfigError naming the field)."""

from __future__ import annotations

import re

import pytest
import torch

from fedmq.experiments.config import parse_config
from fedmq.fedcore import aggregation
from fedmq.fedcore.aggregation import AGGREGATORS, build_aggregator, weighted_average
from fedmq.fedcore.errors import ConfigError


def test_the_default_rule_is_the_weighted_mean() -> None:
    """`mean` is the weighted mean the methods used before the hook existed, and takes no options."""
    assert build_aggregator("mean") is weighted_average
    states = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([4.0])}]
    assert torch.equal(build_aggregator("mean")(states, [2.0, 1.0])["w"], torch.tensor([2.0]))
    with pytest.raises(ConfigError, match=re.escape("method.aggregator.options: aggregator 'mean' takes no options")):
        build_aggregator("mean", {"cv_t": 0.3})


def test_unknown_rule_is_a_config_error_listing_the_available_ones() -> None:
    with pytest.raises(
        ConfigError, match=re.escape("method.aggregator.name: unknown aggregator 'krum'; available: ")
    ) as err:
        build_aggregator("krum")
    assert all(name in str(err.value) for name in AGGREGATORS)


def test_every_lookup_of_an_unknown_rule_lists_the_known_ones() -> None:
    """The registry's one lookup (`aggregation.rule`) serves building a rule and asking whether it
    folds stale updates: both refuse a name it does not hold with the same list of the ones it does."""
    known = f"available: {', '.join(sorted(AGGREGATORS))}"
    for ask in (aggregation.rule, aggregation.async_refusal):
        with pytest.raises(ConfigError, match=re.escape(f"method.aggregator.name: unknown aggregator 'Mean'; {known}")):
            ask("Mean")
    assert aggregation.async_refusal("mean") is None
    assert "cannot aggregate asynchronously" in str(aggregation.async_refusal("median"))


def test_experiment_files_default_to_the_mean_and_reject_unknown_keys() -> None:
    """An experiment without `aggregator` keeps each method's own mean; a typo in the section is an error."""
    cfg = parse_config({"name": "x", "nodes": 2, "rounds": 1, "method": {"name": "fedprox"}})
    assert cfg.method.aggregator.name == "mean" and cfg.method.aggregator.options == {}
    with pytest.raises(ConfigError, match="aggregator"):
        parse_config(
            {"name": "x", "nodes": 2, "rounds": 1, "method": {"name": "fedprox", "aggregator": {"nme": "fedsa"}}}
        )


def test_fedsa_options_are_validated_and_buffers_stay_plain_means() -> None:
    """FedSA's rule comes with its own options (checked like hyperparameters) and learns the model's
    buffers, which it averages plainly instead of clustering them."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    rule = build_aggregator("fedsa", {"cv_t": 0.3}, model=model)
    assert rule.hp.cv_t == 0.3 and "1.running_mean" in rule.frozen and "0.weight" not in rule.frozen
    with pytest.raises(ConfigError, match=re.escape("method.aggregator.options: unknown options ['cvt']")):
        build_aggregator("fedsa", {"cvt": 0.3})
    with pytest.raises(ConfigError, match=re.escape("method.aggregator.options.c_mic")):
        build_aggregator("fedsa", {"c_mic": "four"})
    # the per-tensor log is the FedSA method's (its server half writes it), not the rule's
    with pytest.raises(ConfigError, match=re.escape("unknown options ['log_layers']")):
        build_aggregator("fedsa", {"log_layers": False})


def test_an_experiment_puts_the_rule_in_place_of_the_methods_mean(tmp_path) -> None:
    """`build_coordinator` gives FedProx's server FedSA's rule; without `aggregator` it keeps the mean."""
    from fedmq.experiments.build import build_coordinator
    from fedmq.fedcore.aggregation.skew_aware import SkewAwareAggregator

    def coordinator(method: dict) -> object:
        cfg = parse_config(
            {
                "name": "x",
                "nodes": 2,
                "rounds": 1,
                "data": {"dataset": "digits"},
                "model": {"name": "mlp"},
                "method": method,
            }
        )
        return build_coordinator(cfg, "mqtt://127.0.0.1:1", tmp_path).half

    with_sa = coordinator({"name": "fedprox", "aggregator": {"name": "fedsa"}})
    assert isinstance(with_sa.average, SkewAwareAggregator)
    assert coordinator({"name": "fedprox"}).average is weighted_average
