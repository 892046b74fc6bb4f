"""The engine's secure-aggregation steps (`coordinator.engine.secure`) against messages a node or an
insider should not send, on the quickstart federation in process (`build_local`): each is refused
with its reason and the round still unmasks the right sum, or ends without a model; never a wrong one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from fedmq.broker import Kind, Message
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.experiments.config import apply_overrides, parse_config, read_yaml
from fedmq.experiments.local import build_local
from fedmq.fedcore.protocol import SecAggDirectory, SecAggKeys, SecAggShared, SecAggShares

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


def _federation(*overrides: str) -> Any:
    data = apply_overrides(
        read_yaml(ROOT / "experiments" / "quickstart.yaml"),
        ["train.local_epochs=1", "rounds=1", "privacy.secure_aggregation={}", *overrides],
    )
    return build_local(parse_config(data), device=torch.device("cpu"))


def _undisturbed_model() -> dict[str, torch.Tensor]:
    fed = _federation()
    fed.run()
    return fed.model()


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float = 1e-6) -> bool:
    return all(float((a[k].double() - b[k].double()).abs().max()) <= tolerance for k in a)


def _intercept(fed: Any, change: Any) -> None:
    """Pass every command the engine gives through `change` (which may add events) before it runs."""
    execute = fed._execute

    def run(command: c.Command) -> None:
        execute(change(command))

    fed._execute = run


def _forge_one_share(fed: Any) -> None:
    """Alter one ciphertext of the first `secagg-shared` the coordinator sends (an insider's forged share)."""
    forged: list[str] = []

    def tamper(command: c.Command) -> c.Command:
        if isinstance(command, c.SendSecAgg) and isinstance(command.message, SecAggShared) and not forged:
            forged.append(command.node)
            sender, sealed = next(iter(command.message.shares.items()))
            shares = dict(command.message.shares) | {sender: sealed[:-1] + bytes([sealed[-1] ^ 1])}
            return dataclasses.replace(command, message=dataclasses.replace(command.message, shares=shares))
        return command

    _intercept(fed, tamper)


def _inject(fed: Any, node: str, kind: Kind, meta: dict[str, Any]) -> None:
    message = Message(kind=kind, federation=fed.engine.config.federation, round=0, sender=node, meta=meta)
    fed.at(fed.clock.now(), e.SecAggArrived(message, fed.clock.now()))


def test_keys_out_of_step_and_forged_or_repeated_shares_are_refused_and_the_round_unmasks() -> None:
    """Around each node's own shares: keys again (out of step), shares addressed to a node that is not
    its neighbour (before its own), and shares to its true neighbours (after them). All refused; the
    genuine steps go on and the model is the undisturbed run's, bit for bit."""
    expected = _undisturbed_model()
    fed = _federation()
    execute = fed._execute

    def forge(command: c.Command) -> None:
        message = command.message if isinstance(command, c.SendSecAgg) else None
        if not isinstance(message, SecAggDirectory):
            return execute(command)
        node, task = command.node, message.task_id  # type: ignore[union-attr]
        keys = SecAggKeys(task_id=task, encryption_key=b"k" * 32, mask_key=b"m" * 32)
        _inject(fed, node, Kind.SECAGG_KEYS, keys.to_meta())
        stranger = SecAggShares(task_id=task, commitment=b"c" * 32, shares={"node-999": b"x" * 96})
        _inject(fed, node, Kind.SECAGG_SHARES, stranger.to_meta())
        execute(command)  # the node's own shares go out
        again = SecAggShares(task_id=task, commitment=b"c" * 32, shares=dict.fromkeys(message.neighbours, b"x" * 96))
        _inject(fed, node, Kind.SECAGG_SHARES, again.to_meta())
        return None

    fed._execute = forge
    records = fed.run()
    assert records[0]["aggregated"] and records[0]["secagg_survivors"] == 5
    # the last node's repeated shares come once everyone's are in and the step is over: out of step
    assert dict(fed.refused) == {"secagg-out-of-step": 6, "bad-secagg": 5, "duplicate-secagg": 4}
    assert _close(expected, fed.model(), 0.0)


def test_an_update_before_the_masking_step_is_refused() -> None:
    fed = _federation()
    sent: list[c.SendSecAgg] = []

    def early(command: c.Command) -> c.Command:
        if isinstance(command, c.SendSecAgg) and not sent:
            sent.append(command)
            meta = {"task": command.message.task_id, "num_samples": 10, "train_seconds": 1.0, "payload": {}}
            message = Message(
                kind=Kind.UPDATE, federation=fed.engine.config.federation, round=0, sender=command.node, meta=meta
            )
            fed.at(fed.clock.now(), e.UpdateArrived(message, fed.clock.now()))
        return command

    _intercept(fed, early)
    records = fed.run()
    assert fed.refused["secagg-out-of-step"] == 1 and records[0]["aggregated"]


def test_a_forged_share_is_refused_by_its_receiver_and_the_sum_comes_from_the_others() -> None:
    """One ciphertext the coordinator forwards is altered (an insider's forged share): its receiver
    refuses to reveal anything (forged-share), and the others' reveals still rebuild every secret (5
    nodes, 4 neighbours each, t = 2): the model is the undisturbed run's."""
    expected = _undisturbed_model()
    fed = _federation()
    _forge_one_share(fed)
    records = fed.run()
    assert records[0]["aggregated"] and records[0]["secagg_survivors"] == 5
    assert _close(expected, fed.model(), 0.0)


def test_a_forged_share_with_no_spare_holders_ends_the_round_without_a_model() -> None:
    """The same with threshold 1.0 (t = 4 of 4 neighbours): the receiver's silence leaves secrets one
    share short, so the attempt ends unaggregated with the reason, and the model is unchanged."""
    fed = _federation("privacy.secure_aggregation={threshold: 1.0}", "policy.on_insufficient=skip")
    before = fed.model()
    _forge_one_share(fed)
    records = fed.run()
    assert not records[0]["aggregated"] and "needs 4 shares" in records[0]["secure_aggregation_failed"]
    assert _close(before, fed.model(), 0.0)
