"""Sampling and the round state: deterministic cohorts, K = max(1, floor(C x live)), and when a round closes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedmq.coordinator.errors import ProtocolError
from fedmq.coordinator.registry import NodeRegistry
from fedmq.coordinator.rounds import RoundState
from fedmq.coordinator.sampler import cohort_size, sample
from fedmq.fedcore.algorithms.base import NodeUpdate, Payload
from fedmq.fedcore.protocol import Announcement

LIVE = [f"node-{i:03d}" for i in range(100)]


@pytest.mark.parametrize(
    ("live", "fraction", "k"), [(100, 0.1, 10), (9, 0.1, 1), (1, 0.01, 1), (20, 0.25, 5), (7, 1.0, 7), (0, 0.5, 0)]
)
def test_cohort_size_is_max_one_floor_c_times_live(live: int, fraction: float, k: int) -> None:
    assert cohort_size(live, fraction) == k


def test_sample_is_deterministic_whatever_the_live_order() -> None:
    """Same live set, seed, round and attempt: the same cohort, even if nodes announced in another order."""
    a = sample(LIVE, fraction=0.1, over_selection=1.0, seed=3, round=5)
    b = sample(list(reversed(LIVE)), fraction=0.1, over_selection=1.0, seed=3, round=5)
    assert a == b and len(a.selected) == 10 and a.target == 10 and len(set(a.selected)) == 10
    others = {sample(LIVE, fraction=0.1, over_selection=1.0, seed=3, round=r).selected for r in range(6, 12)}
    assert len(others) == 6
    assert sample(LIVE, fraction=0.1, over_selection=1.0, seed=3, round=5, attempt=1) != a


def test_sample_is_uniform_over_many_rounds() -> None:
    """Every node is picked about C x rounds times (binomial, 5 sigma bounds)."""
    counts = {n: 0 for n in LIVE}
    for r in range(2000):
        for n in sample(LIVE, fraction=0.1, over_selection=1.0, seed=0, round=r).selected:
            counts[n] += 1
    values = np.array(list(counts.values()))
    assert abs(values.mean() - 200) < 1e-9 and values.min() > 200 - 5 * 13.5 and values.max() < 200 + 5 * 13.5


def test_sample_over_selection_and_carried_updates() -> None:
    """Over-selection asks ceil(f x K) nodes but still targets K; carried nodes count and are not asked."""
    over = sample(LIVE, fraction=0.1, over_selection=1.3, seed=0, round=0)
    assert len(over.selected) == 13 and over.target == 10
    carried = over.selected[:4]
    retry = sample(LIVE, fraction=0.1, over_selection=1.0, seed=0, round=0, attempt=1, already=carried)
    assert len(retry.selected) == 6 and retry.target == 10 and not set(retry.selected) & set(carried)
    assert sample(LIVE[:3], fraction=0.5, over_selection=3.0, seed=0, round=0).selected == tuple(LIVE[:3])


def _update(node: str) -> NodeUpdate:
    return NodeUpdate(node_id=node, round=0, num_samples=1, payload=Payload(tensors={"model": {"w": torch.zeros(1)}}))


def _state(selected: tuple[str, ...], target: int | None = None) -> RoundState:
    return RoundState(
        round=0, attempt=0, task_id=b"t" * 16, selected=selected, target=target or len(selected), schema={}
    )


def test_round_closes_when_every_live_selected_node_answered() -> None:
    state = _state(("a", "b", "c"))
    state.on_accepted(_update("a"))
    state.on_failed("b", "out of memory")
    assert not state.done
    state.on_offline("c")
    assert state.done
    outcome = state.close(lambda n: n != "c")
    assert (outcome.accepted, outcome.failed, outcome.lost, outcome.late) == (("a",), ("b",), ("c",), ())


def test_round_refused_message_does_not_answer_for_its_node() -> None:
    """b's refused message leaves b pending (its valid update may follow); c sent only refused
    messages and went silent: rejected at the close, not late; a's refusal is forgotten once its
    update is accepted."""
    state = _state(("a", "b", "c"))
    state.on_rejected("a", "samples-mismatch")
    state.on_accepted(_update("a"))
    state.on_rejected("b", "wrong-shape")
    state.on_rejected("c", "non-finite")
    assert not state.done and state.pending == {"b", "c"} and not state.answered("b")
    state.on_accepted(_update("b"))
    state.on_offline("c")
    assert state.done
    outcome = state.close(lambda n: n != "c")
    assert (outcome.accepted, outcome.rejected, outcome.lost, outcome.late) == (("a", "b"), ("c",), (), ())


def test_round_over_selected_closes_at_target_and_the_rest_are_late() -> None:
    state = _state(("a", "b", "c", "d"), target=2)
    state.on_accepted(_update("c"))
    assert not state.done
    state.on_accepted(_update("a"))
    assert state.done
    outcome = state.close(lambda n: True)
    assert outcome.late == ("b", "d") and outcome.lost == ()


def test_round_acks_complete_when_all_acked_or_gone() -> None:
    state = _state(("a", "b"))
    state.on_ack("a")
    assert not state.acks_complete
    state.on_offline("b")
    assert state.acks_complete


def test_round_carried_updates_count_towards_the_target() -> None:
    state = RoundState(
        round=0, attempt=1, task_id=b"t" * 16, selected=("c",), target=2, schema={}, carried={"a": _update("a")}
    )
    state.on_accepted(_update("c"))
    assert state.done and set(state.updates) == {"a", "c"}


def test_registry_tracks_liveness_and_validates_announcements() -> None:
    reg = NodeRegistry()
    assert reg.apply_status("n1", {"state": "online", "num_samples": 5, "device": "cpu"}) is True
    assert reg.apply_status("n1", {"state": "online"}) is None
    assert reg.live_ids() == ["n1"] and reg.get("n1").num_samples == 5  # type: ignore[union-attr]
    assert reg.apply_status("n1", {"state": "offline"}) is False
    assert reg.live_ids() == []
    for bad in [{"state": "zombie"}, {"state": "online", "num_samples": -1}, {"state": "online", "num_samples": True},
                {"state": "online", "label_histogram": [1, "x"]}, {"state": "online", "device": 3}]:  # fmt: skip
        with pytest.raises(ProtocolError, match="bad-status"):
            Announcement.from_meta(bad)
