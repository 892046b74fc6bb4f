"""Secure aggregation in `fedmq simulate` (issue 32, items 1 and 3): the nodes really mask their
updates and the masks really cancel. A secure round's model equals the plain round's within the
quantisation's bound, the half only ever sees the sum, nodes that drop after sharing are unmasked
from their neighbours' shares, and too many dropouts end the attempt without a model (never a
wrong one). The federation is the quickstart's (scikit-learn's digits, 10 nodes, FedAvg)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedmq.coordinator.halfcalls import SECURE_SUM
from fedmq.experiments.config import ExperimentConfig, apply_overrides, parse_config, read_yaml
from fedmq.experiments.local import build_local
from fedmq.fedcore import masked as m
from fedmq.fedcore.algorithms.base import NodeUpdate

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
BASE = ["train.local_epochs=1"]
SECURE = ["privacy.secure_aggregation={}"]


def _cfg(*overrides: str) -> ExperimentConfig:
    return parse_config(apply_overrides(read_yaml(ROOT / "experiments" / "quickstart.yaml"), [*BASE, *overrides]))


def _federation(cfg: ExperimentConfig, **fields: Any) -> Any:
    fed = build_local(cfg, device=torch.device("cpu"))
    for name, value in fields.items():
        setattr(fed, name, value)
    return fed


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def test_a_secure_round_equals_the_plain_round_within_the_quantisation_bound() -> None:
    plain = _federation(_cfg("rounds=1"))
    plain.run()
    secure = _federation(_cfg("rounds=1", *SECURE))
    seen: list[list[NodeUpdate]] = []
    aggregate = secure.half.aggregate

    def spy(ctx: Any, updates: list[NodeUpdate], failures: Any) -> Any:
        seen.append(list(updates))
        return aggregate(ctx, updates, failures)

    secure.half.aggregate = spy
    records = secure.run()
    assert len(records) == 1 and records[0]["aggregated"]
    survivors = records[0]["accepted"]
    assert len(survivors) == 5 and records[0]["secagg_survivors"] == 5 and records[0]["secagg_dropped"] == 0
    # the half saw one update, the survivors' mean, and no node's own
    assert [[u.node_id for u in call] for call in seen] == [[SECURE_SUM]]
    assert seen[0][0].num_samples == sum(len(secure.nodes[n].data) for n in survivors)
    bound = records[0]["secagg_error_bound"]
    assert 0 < bound < 1e-6
    difference = _max_difference(plain.model(), secure.model())
    assert difference <= bound + 1e-6  # the plain mean's own float32 rounding besides the quantisation's
    assert records[0]["train_loss"] == pytest.approx(plain.records[0]["train_loss"])


def test_the_masked_updates_reveal_nothing_of_a_nodes_change() -> None:
    """What reaches the coordinator from a node is uniform noise: uncorrelated with the node's change."""
    fed = _federation(_cfg("rounds=1", *SECURE))
    arrived: list[Any] = []
    handle = fed.engine.handle

    def record(event: Any, now: float) -> Any:
        if type(event).__name__ == "UpdateArrived":
            arrived.append(event.message)
        return handle(event, now)

    fed.engine.handle = record
    fed.run()
    assert len(arrived) == 5
    for message in arrived:
        values = m.from_wire(np.asarray(message.tensors[f"{m.GROUP}/{m.TENSOR}"])).astype(np.float64)
        assert values.mean() / 2**32 == pytest.approx(0.5, abs=0.02)  # uniform over [0, 2^32)


def test_a_node_that_drops_after_sharing_is_unmasked_from_its_neighbours_shares() -> None:
    """node-X shares its seeds and never sends its update: the others' sum is unmasked (its pairwise
    masks removed with its reconstructed key), equal to a plain round in which node-X dropped the task."""
    cfg = _cfg("rounds=1", *SECURE)
    probe = _federation(cfg)
    probe.run()
    dropped = probe.records[0]["accepted"][0]
    secure = _federation(cfg, secure_faults={dropped: "update"})
    records = secure.run()
    assert records[0]["aggregated"] and dropped not in records[0]["accepted"]
    assert records[0]["secagg_dropped"] == 1 and records[0]["secagg_survivors"] == 4
    plain = _federation(_cfg("rounds=1"), compute_s=lambda node, task: None if node == dropped else 0.0)
    plain.run()
    assert plain.records[0]["accepted"] == records[0]["accepted"]
    assert _max_difference(plain.model(), secure.model()) <= records[0]["secagg_error_bound"] + 1e-6


def test_too_many_dropouts_end_the_attempt_without_a_model() -> None:
    """With neighbours 2 and threshold 1 (t = 2 shares), three of five nodes silent at the reveal leave
    some secret with too few holders: the attempt ends with the reason, and the model stays as it was."""
    cfg = _cfg("rounds=1", "privacy.secure_aggregation={neighbours: 2, threshold: 1.0}", "policy.max_retries=0")
    probe = _federation(cfg)
    probe.run()
    selected = probe.records[0]["accepted"]
    fed = _federation(cfg, secure_faults={n: "reveal" for n in selected[:3]})
    before = fed.model()
    records = fed.run()
    assert not records[-1]["aggregated"]
    assert "shares" in records[-1]["secure_aggregation_failed"]
    assert _max_difference(before, fed.model()) == 0.0


def test_a_secure_simulation_matches_the_plain_run_and_replays_bit_for_bit(tmp_path: Path) -> None:
    """`fedmq simulate` end to end, with a node dropping after sharing in round 1; `fedmq replay`
    recomputes the updates unmasked and reaches the recorded model, bit for bit."""
    from fedmq.experiments.replay import replay_run
    from fedmq.experiments.simulate import simulate

    late = ["faults={node-008: {delay_s: 100, delay_rounds: [1]}}"]  # selected in round 1, after the deadline
    simulate(_cfg("rounds=3", *SECURE, *late), tmp_path / "secure", device=torch.device("cpu"))
    simulate(_cfg("rounds=3", *late), tmp_path / "plain", device=torch.device("cpu"))
    lines = [json.loads(line) for line in (tmp_path / "secure" / "metrics.jsonl").read_text().splitlines()]
    assert [line["secagg_dropped"] for line in lines] == [0, 1, 0] and "node-008" not in lines[1]["accepted"]
    secure = json.loads((tmp_path / "secure" / "summary.json").read_text())
    plain = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert secure["final_accuracy"] == pytest.approx(plain["final_accuracy"], abs=0.01)
    outcome = replay_run(tmp_path / "secure")
    assert outcome.ok and outcome.report.final_model_sha256 == secure["model_sha256"]
    assert outcome.report.updates == 14 and outcome.report.aggregations == 3


SECURE_BASE = {
    "name": "x",
    "nodes": 20,
    "policy": {"fraction": 0.25},
    "rounds": 5,
    "privacy": {"secure_aggregation": {}},
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"engine": {"kind": "async"}}, "it unmasks one attempt's updates together"),
        ({"policy": {"fraction": 0.25, "late_updates": "carry"}}, "it unmasks one attempt's updates together"),
        ({"method": {"aggregator": {"name": "median"}}}, "must see each update"),
        (
            {
                "privacy": {
                    "secure_aggregation": {},
                    "mechanism": "central",
                    "adaptive_clipping": True,
                    "count_noise": 5,
                }
            },
            "adaptive clipping needs the count",
        ),
        ({"hierarchy": {"sites": 2}}, "site aggregators would unmask"),
        ({"compression": {"mode": "int8-block"}}, "masked integers do not compress"),
        ({"policy": {"fraction": 0.1}}, "a round selects 2 node(s)"),
        ({"privacy": {"secure_aggregation": {"threshold": 0}}}, "threshold"),
    ],
)
def test_what_secure_aggregation_cannot_run_with_is_refused_at_load(changes: dict[str, Any], message: str) -> None:
    from fedmq.fedcore.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(SECURE_BASE | changes)


def test_a_method_whose_aggregation_reads_each_update_is_refused_when_built() -> None:
    from fedmq.experiments.build import coordinator_half, load_split
    from fedmq.fedcore.errors import ConfigError

    cfg = parse_config(SECURE_BASE | {"method": {"name": "scaffold"}, "data": {"dataset": "digits"}})
    with pytest.raises(ConfigError, match="scaffold cannot run with secure aggregation: its aggregation needs more"):
        coordinator_half(cfg, load_split(cfg))


def test_central_dp_with_secure_aggregation_equals_central_dp_in_clear_within_the_bound() -> None:
    """DP-FedAvg with the masks: each node clips its change to S and divides it by K before masking,
    the coordinator adds the round's noise to the unmasked sum. The noise comes from the same stream
    in the same order as the rule's in clear, so one round's model is the in-clear one's within the
    quantisation's bound, and the epsilon the same."""
    central = ["privacy.mechanism=central", "privacy.noise_multiplier=1.0", "privacy.clip_norm=0.5", "rounds=1"]
    clear = _federation(_cfg(*central))
    clear.run()
    masked = _federation(_cfg(*central, *SECURE))
    records = masked.run()
    assert records[0]["dp_epsilon"] == clear.records[0]["dp_epsilon"] and records[0]["secagg_survivors"] == 5
    assert records[0]["dp_noise_std"] == clear.records[0]["dp_noise_std"] > 0
    assert _max_difference(clear.model(), masked.model()) <= records[0]["secagg_error_bound"] + 1e-6
    quieter = _federation(_cfg(*central[:1], "privacy.noise_multiplier=0.01", *central[2:], *SECURE))
    quieter.run()
    assert _max_difference(quieter.model(), masked.model()) > 1e-3  # the noise is really there
