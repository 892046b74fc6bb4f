"""The rendezvous where a process's nodes of one task meet to train together (hosting.vectorize)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from fedmq.fedcore.algorithms import build_hyperparams, get_algorithm
from fedmq.fedcore.algorithms.base import GroupMember, NodeHalf, Payload, TaskInput
from fedmq.fedcore.data import TensorDataset
from fedmq.fedcore.models import build_model
from fedmq.fedcore.training import TrainSettings
from fedmq.fednode.groups import GroupTrainer
from fedmq.fednode.workspace import Workspace

KEY = (3, 0, b"t" * 16, TrainSettings())
DATA = TensorDataset(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 3)


class Recording(NodeHalf):
    """Records the groups it trains; each member's update names it."""

    def __init__(self, hp: object = None, *, node_id: str, groups: list[list[str]], fail: bool = False) -> None:
        super().__init__(hp, node_id=node_id)
        self.groups, self.fail = groups, fail

    def train(self, task: TaskInput, model: nn.Module, data: TensorDataset, generator: torch.Generator) -> Payload:
        raise AssertionError("the rendezvous never trains one node alone; the daemon does")

    def train_group(self, members: Sequence[GroupMember], model: nn.Module) -> list[Payload]:
        self.groups.append([m.task.node_id for m in members])
        if self.fail:
            raise RuntimeError("boom")
        return [Payload(meta={"node": m.task.node_id}) for m in members]


def member(node: str, groups: list[list[str]], *, fail: bool = False) -> GroupMember:
    return GroupMember(
        half=Recording(node_id=node, groups=groups, fail=fail),
        task=TaskInput(node_id=node, round=3, payload=Payload(), settings=TrainSettings()),
        data=DATA,
        generator=torch.Generator(),
    )


def trainer(wait_s: float) -> GroupTrainer:
    workspace = Workspace(build_model("mlp", (4,), 3, seed=0), torch.device("cpu"), group_wait_s=wait_s)
    assert workspace.groups is not None
    return workspace.groups


async def test_group_trains_every_expected_node_together_in_node_order() -> None:
    """Three nodes acknowledged; when the last model arrives the group trains once, members sorted."""
    groups: list[list[str]] = []
    rendezvous = trainer(wait_s=60)
    for node in ("node-2", "node-0", "node-1"):
        rendezvous.expect(KEY, node)
    results = await asyncio.wait_for(
        asyncio.gather(*(rendezvous.train(KEY, member(n, groups)) for n in ("node-2", "node-0", "node-1"))), 30
    )
    assert groups == [["node-0", "node-1", "node-2"]]
    assert [r[0].meta["node"] for r in results if r is not None] == ["node-2", "node-0", "node-1"]
    assert len({r[1] for r in results if r is not None}) == 1 and rendezvous.groups_trained == 1


async def test_node_whose_model_is_late_trains_alone_and_the_others_go_on() -> None:
    """node-2 acknowledged but its model comes after the bound: the others train together without it,
    and it is then told to train alone (None), never held back."""
    groups: list[list[str]] = []
    rendezvous = trainer(wait_s=0.05)
    for node in ("node-0", "node-1", "node-2"):
        rendezvous.expect(KEY, node)
    first = await asyncio.wait_for(
        asyncio.gather(*(rendezvous.train(KEY, member(n, groups)) for n in ("node-0", "node-1"))), 30
    )
    assert groups == [["node-0", "node-1"]] and all(r is not None for r in first)
    assert await asyncio.wait_for(rendezvous.train(KEY, member("node-2", groups)), 30) is None
    assert groups == [["node-0", "node-1"]]


async def test_withdrawn_node_is_not_waited_for() -> None:
    """A node that will not come (another task replaced this one) is withdrawn: the group starts at once
    (with a one-minute bound the test would time out otherwise)."""
    groups: list[list[str]] = []
    rendezvous = trainer(wait_s=60)
    for node in ("node-0", "node-1", "node-2"):
        rendezvous.expect(KEY, node)
    joined = [asyncio.create_task(rendezvous.train(KEY, member(n, groups))) for n in ("node-0", "node-1")]
    await asyncio.sleep(0)
    rendezvous.withdraw(KEY, "node-2")
    await asyncio.wait_for(asyncio.gather(*joined), 30)
    assert groups == [["node-0", "node-1"]]


async def test_group_of_one_and_unexpected_nodes_train_alone() -> None:
    groups: list[list[str]] = []
    rendezvous = trainer(wait_s=60)
    rendezvous.expect(KEY, "node-0")
    assert await asyncio.wait_for(rendezvous.train(KEY, member("node-0", groups)), 30) is None
    assert await rendezvous.train(KEY, member("node-9", groups)) is None
    assert groups == []


async def test_failed_group_training_sends_every_member_back_to_train_alone() -> None:
    groups: list[list[str]] = []
    rendezvous = trainer(wait_s=60)
    rendezvous.expect(KEY, "node-0")
    rendezvous.expect(KEY, "node-1")
    results = await asyncio.wait_for(
        asyncio.gather(*(rendezvous.train(KEY, member(n, groups, fail=True)) for n in ("node-0", "node-1"))), 30
    )
    assert results == [None, None] and groups == [["node-0", "node-1"]] and rendezvous.groups_trained == 0


@pytest.mark.parametrize(
    ("method", "hyperparams", "admitted"),
    [("fedavg", {}, True), ("fedprox", {}, True), ("moon", {}, True), ("scaffold", {}, True), ("fedacd", {}, True),
     ("fedacd", {"p_estimate": "clean"}, True), ("scaffold", {"control_update": "gradient_mean"}, True)],
)  # fmt: skip
def test_rendezvous_admits_only_methods_with_a_group_form(
    method: str, hyperparams: dict[str, str], admitted: bool
) -> None:
    spec = get_algorithm(method)
    rendezvous = trainer(wait_s=1)
    rendezvous.model = build_model("mlp", (1, 8, 8), 10, seed=0)
    assert rendezvous.admits(spec.node(build_hyperparams(spec, hyperparams), node_id="node-0")) is admitted


def test_rendezvous_refuses_a_method_without_a_group_form() -> None:
    """Every built-in method has one; a user's loss-term method that writes only `objective` has none."""
    from fedmq.fedcore.algorithms import shared

    class OwnTerm(shared.LossTermNode):
        def objective(self, task, model, data):  # type: ignore[no-untyped-def]
            return None

    rendezvous = trainer(wait_s=1)
    rendezvous.model = build_model("mlp", (1, 8, 8), 10, seed=0)
    assert not rendezvous.admits(OwnTerm(build_hyperparams(get_algorithm("fedavg"), {}), node_id="node-0"))


def test_rendezvous_refuses_a_batchnorm_model_outside_fedavgs_objective_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FedAvg's node half trains a BatchNorm model in groups (fedcore.masked_norm); MOON's is refused."""
    workspace = Workspace(build_model("resnet32", (3, 32, 32), 10, seed=0), torch.device("cpu"), group_wait_s=1)
    assert workspace.groups is not None
    fedavg = get_algorithm("fedavg")
    assert workspace.groups.admits(fedavg.node(build_hyperparams(fedavg, {}), node_id="node-0"))
    spec = get_algorithm("moon")
    half = spec.node(build_hyperparams(spec, {}), node_id="node-0")
    with caplog.at_level("WARNING"):
        assert not workspace.groups.admits(half) and not workspace.groups.admits(half)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "BatchNorm" in caplog.records[0].message


def test_workspace_without_group_wait_has_no_rendezvous() -> None:
    assert Workspace(build_model("mlp", (4,), 3, seed=0), torch.device("cpu")).groups is None
