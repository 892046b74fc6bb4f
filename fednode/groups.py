"""Where the nodes of one process that acknowledged the same task meet, to be trained together.

With ``hosting.vectorize`` on, a node that acknowledges a task whose method can train in groups
(`NodeHalf.group_refusal` is None for the workspace's model) is *expected* in that task's group.
When its model arrives it joins; the group trains as soon as every expected node has joined, or
`wait_s` after the first one joined, with those that did (a node whose model comes later trains
alone, as does a group of one). The group trains under the workspace lock, in a worker thread,
through `NodeHalf.train_group`; each node then encodes and publishes its own update. If group
training fails, every member trains alone, so an update is never lost to the grouping.

Membership is deterministic when the models arrive within `wait_s` (the group is then exactly the
nodes that acknowledged), and members are ordered by node id. Grouped results equal one-by-one
results within float tolerance only (`fedcore.vectorized`), so with grouping on a run is
reproducible given its seed only up to that tolerance: the sums inside a vectorised step depend
on who else is in the group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import nn

from fedmq.fedcore.algorithms.base import GroupMember, NodeHalf, Payload

logger = logging.getLogger(__name__)

GroupKey = Hashable
"""What members of one group share: (round, attempt, task id, settings), chosen by the daemon."""

Grouped = tuple[Payload, float] | None
"""A member's update and its share of the group's training seconds; None: train alone."""


@dataclass(eq=False)
class _Group:
    expected: set[str]
    members: dict[str, tuple[GroupMember, asyncio.Future[Grouped]]] = field(default_factory=dict)
    full: asyncio.Event = field(default_factory=asyncio.Event)
    launcher: asyncio.Task[None] | None = None

    def check_full(self) -> None:
        if self.members and self.expected <= set(self.members):
            self.full.set()


class GroupTrainer:
    """The rendezvous of one process's nodes (one per `Workspace`); see the module docstring."""

    def __init__(self, model: nn.Module, lock: asyncio.Lock, wait_s: float, *, logger: logging.Logger = logger) -> None:
        if wait_s <= 0:
            raise ValueError(f"wait_s must be positive, got {wait_s!r}")
        self.model = model
        self.lock = lock
        """The workspace's model and lock: the nodes of one process train in one model, one at a time."""
        self.wait_s = wait_s
        self.log = logger
        self.groups_trained = 0
        self.warned_inline = False
        """Whether a node said once that inline models (sent with the task) defeat the grouping."""
        self._groups: dict[GroupKey, _Group] = {}
        self._refusals: dict[type, str | None] = {}
        self._launchers: set[asyncio.Task[None]] = set()

    def admits(self, half: NodeHalf) -> bool:
        """Whether nodes of this half's class can be grouped with the workspace's model (the reason
        why not is logged once per class)."""
        kind = type(half)
        if kind not in self._refusals:
            reason = self._refusals[kind] = half.group_refusal(self.model)
            if reason is not None:
                self.log.warning("hosting.vectorize is on but nodes train one by one: %s", reason)
        return self._refusals[kind] is None

    def expect(self, key: GroupKey, node_id: str) -> None:
        """`node_id` acknowledged the task `key`: its group waits for its model (at most `wait_s`)."""
        group = self._groups.setdefault(key, _Group(expected=set()))
        group.expected.add(node_id)

    def withdraw(self, key: GroupKey, node_id: str) -> None:
        """`node_id` will not join `key`'s group after all (another task replaced it, it stops)."""
        group = self._groups.get(key)
        if group is None or node_id in group.members:
            return
        group.expected.discard(node_id)
        if not group.expected and not group.members:
            del self._groups[key]
        else:
            group.check_full()

    async def train(self, key: GroupKey, member: GroupMember) -> Grouped:
        """This member's update, trained with its group; None when it must train alone (it was not
        expected, its group started without it, or nobody else came)."""
        group = self._groups.get(key)
        node_id = member.task.node_id
        if group is None or node_id not in group.expected or node_id in group.members:
            return None
        result: asyncio.Future[Grouped] = asyncio.get_running_loop().create_future()
        group.members[node_id] = (member, result)
        if group.launcher is None:
            group.launcher = asyncio.create_task(self._launch(key, group), name=f"train-group-{member.task.round}")
            self._launchers.add(group.launcher)
            group.launcher.add_done_callback(self._harvest)
        group.check_full()
        return await result

    async def _launch(self, key: GroupKey, group: _Group) -> None:
        try:
            try:
                await asyncio.wait_for(group.full.wait(), self.wait_s)
            except TimeoutError:
                missing = sorted(group.expected - set(group.members))
                self.log.info("group starts without %s: no model within %g s", ", ".join(missing), self.wait_s)
            if self._groups.get(key) is group:
                del self._groups[key]  # who comes later trains alone
            members = [group.members[n] for n in sorted(group.members)]
            if len(members) > 1:
                await self._train(members)
        finally:
            for _, result in group.members.values():  # anything left (a failure, a group of one): alone
                if not result.done():
                    result.set_result(None)

    async def _train(self, members: list[tuple[GroupMember, asyncio.Future[Grouped]]]) -> None:
        group = [m for m, _ in members]
        async with self.lock:
            started = time.perf_counter()
            try:
                payloads = await asyncio.to_thread(group[0].half.train_group, group, self.model)
            except Exception as exc:
                self.log.error("training a group of %d failed, each trains alone: %r", len(group), exc, exc_info=exc)
                return
            seconds = time.perf_counter() - started
        if len(payloads) != len(group):
            self.log.error("train_group gave %d updates for %d nodes; each trains alone", len(payloads), len(group))
            return
        self.groups_trained += 1
        self.log.info("round %d: %d nodes trained together in %.3f s", group[0].task.round, len(group), seconds)
        for (_, result), payload in zip(members, payloads, strict=True):
            if not result.done():
                result.set_result((payload, seconds / len(group)))

    def _harvest(self, task: asyncio.Task[None]) -> None:
        self._launchers.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error("group launcher failed: %r", task.exception(), exc_info=task.exception())
