"""Secure aggregation inside a synchronous round attempt: the coordinator's side of SecAgg+ as pure state.

Bell, Bonawitz, Gascon, Lepoint and Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020 (https://eprint.iacr.org/2020/704), semi-honest variant; the cryptography is
`fedcore.secagg`'s. The attempt's tasks go out as usual, then (docs/privacy.md has the sequence):

    keys      each selected node sends two fresh public keys (`secagg-keys`)
    shares    the coordinator sends each node its neighbours' keys (`secagg-directory`); each node
              sends its seeds' shares, encrypted to each neighbour (`secagg-shares`)
    masked    each node receives the shares addressed to it (`secagg-shared`), masks its weighted
              update against exactly those neighbours and sends it as its update
    unmask    when the round closes (K updates, or the deadline) the coordinator asks each node whose
              update is in (`secagg-unmask`) for the shares that remove the masks: the self-mask of
              each survivor, the mask key of each node that shared and then dropped (`secagg-reveal`)

A step waits for every node still in the round, or `timeout_s`; a node that misses the keys or shares
step is out of the attempt (recorded failed, so the round does not wait for it). Whatever cannot be
unmasked (a secret with fewer than its threshold of shares) ends the attempt without a model, with
the reason in the round's metrics line: never a wrong model. Pure, like the engine: it returns the
messages to send (`SendSecAgg` commands) and reads no clock.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine.commands import SecureSum
from fedmq.coordinator.errors import ProtocolError
from fedmq.fedcore.protocol import (
    SecAggDirectory,
    SecAggKeys,
    SecAggReveal,
    SecAggShared,
    SecAggShares,
    SecAggUnmask,
    SecAggUp,
)
from fedmq.fedcore.secagg import RoundKey, SecAggSettings, neighbour_graph

MIN_PARTICIPANTS = 3
"""Fewer cannot hide one node's update: with two, each learns the other's from the sum and its own."""


class SecurePhase(StrEnum):
    KEYS = "keys"
    SHARES = "shares"
    MASKED = "masked"
    UNMASK = "unmask"
    DONE = "done"


def graph_seed(secret: bytes) -> bytes:
    """The masking graph's shuffle, from the attempt's secret: the same on a replay, unknown to nodes."""
    return hmac.new(secret, b"secagg-graph", hashlib.sha256).digest()


@dataclass(eq=False)
class SecureRound:
    """One attempt's secure aggregation (module docstring). `tasks`: each selected node's task id."""

    settings: SecAggSettings
    key: RoundKey
    tasks: Mapping[str, bytes]
    announced: Mapping[str, int | None]
    """The selected nodes' announced sample counts: a node that announced none cannot be weighted."""
    timeout_s: float
    seed: bytes
    deadline: float | None = None
    phase: SecurePhase = SecurePhase.KEYS
    keys: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    graph: dict[str, tuple[str, ...]] = field(default_factory=dict)
    weight_total: int = 0
    commitments: dict[str, bytes] = field(default_factory=dict)
    ciphertexts: dict[str, Mapping[str, bytes]] = field(default_factory=dict)
    """Per node that sent its shares, its ciphertext for each neighbour."""
    shared: frozenset[str] = frozenset()
    asked: dict[str, SecAggUnmask] = field(default_factory=dict)
    seed_shares: dict[str, dict[str, bytes]] = field(default_factory=dict)
    key_shares: dict[str, dict[str, bytes]] = field(default_factory=dict)
    revealed: set[str] = field(default_factory=set)

    def start(self, now: float) -> None:
        self.deadline = now + self.timeout_s

    # -- what the nodes send -------------------------------------------------------------------------

    def receive(self, node: str, message: SecAggUp) -> None:
        """Take a node's message of the current step (ProtocolError: out of step, twice, or malformed
        against what the node was sent)."""
        if isinstance(message, SecAggKeys):
            self._expect(SecurePhase.KEYS, node, self.keys, "keys")
            self.keys[node] = (message.encryption_key, message.mask_key)
        elif isinstance(message, SecAggShares):
            self._expect(SecurePhase.SHARES, node, self.commitments, "shares")
            if node not in self.graph:
                raise ProtocolError("secagg-out-of-step", f"{node} sent shares but is not in the masking graph")
            if set(message.shares) != set(self.graph[node]):
                raise ProtocolError("bad-secagg", f"{node}'s shares are not addressed to exactly its neighbours")
            self.commitments[node] = message.commitment
            self.ciphertexts[node] = message.shares
        else:
            self._reveal(node, message)

    def _expect(self, phase: SecurePhase, node: str, seen: Mapping[str, object], what: str) -> None:
        if self.phase != phase:
            raise ProtocolError("secagg-out-of-step", f"{node} sent its {what} in the {self.phase} step")
        if node in seen:
            raise ProtocolError("duplicate-secagg", f"{node} sent its {what} twice")

    def _reveal(self, node: str, message: SecAggReveal) -> None:
        if self.phase != SecurePhase.UNMASK or node not in self.asked:
            raise ProtocolError("secagg-out-of-step", f"{node} revealed shares it was not asked for")
        if node in self.revealed:
            raise ProtocolError("duplicate-secagg", f"{node} revealed its shares twice")
        asked = self.asked[node]
        if not set(message.seed_shares) <= set(asked.survivors) or not set(message.key_shares) <= set(asked.dropped):
            raise ProtocolError("bad-secagg", f"{node} revealed shares other than those asked for")
        self.revealed.add(node)
        for owner, share in message.seed_shares.items():
            self.seed_shares.setdefault(owner, {})[node] = share
        for owner, share in message.key_shares.items():
            self.key_shares.setdefault(owner, {})[node] = share

    # -- moving on -----------------------------------------------------------------------------------

    def due(self, now: float, still_in: Callable[[str], bool]) -> bool:
        """Whether the keys or shares step is over: every node still in the round answered it, or its
        deadline passed."""
        if self.phase == SecurePhase.KEYS:
            answered: Mapping[str, object] | frozenset[str] = self.keys
        elif self.phase == SecurePhase.SHARES:
            answered = self.commitments
        else:
            return False
        waiting = [n for n in (self.graph or self.tasks) if n not in answered and still_in(n)]
        return not waiting or (self.deadline is not None and now >= self.deadline)

    def send_directory(self, out: list[c.Command], now: float) -> tuple[list[str], str | None]:
        """After the keys step: the masking graph over the nodes that sent keys and announced a count,
        and each its neighbours' keys. Returns (the nodes left out, why the attempt cannot go on)."""
        counted = sorted(n for n in self.keys if (self.announced.get(n) or 0) > 0)
        out_of_it = sorted(set(self.tasks) - set(counted))
        if len(counted) < MIN_PARTICIPANTS:
            return out_of_it, f"{len(counted)} node(s) sent keys in time, and at least {MIN_PARTICIPANTS} are needed"
        self.graph = neighbour_graph(counted, self.settings.neighbours, self.seed)
        fixed = self.settings.fixed_total  # central DP: the cohort, whoever answers
        self.weight_total = fixed if fixed is not None else sum(int(self.announced[n] or 0) for n in counted)
        for node in counted:
            neighbours = {v: self.keys[v] for v in self.graph[node]}
            out.append(
                c.SendSecAgg(
                    node,
                    self.key.round,
                    SecAggDirectory(task_id=self.tasks[node], neighbours=neighbours, weight_total=self.weight_total),
                )
            )
        self.phase, self.deadline = SecurePhase.SHARES, now + self.timeout_s
        return out_of_it, None

    def send_shared(self, out: list[c.Command]) -> tuple[list[str], str | None]:
        """After the shares step: each node that shared gets the shares addressed to it by neighbours
        that shared. A node left with fewer sharing neighbours than its threshold could never be
        unmasked: it is left out too (and so on, until every node kept has enough)."""
        shared = set(self.commitments)
        while True:
            short = {n for n in shared if len(set(self.graph[n]) & shared) < self._needed(n)}
            if not short:
                break
            shared -= short
        out_of_it = sorted(set(self.tasks) - shared)
        if len(shared) < MIN_PARTICIPANTS:
            return (
                out_of_it,
                f"{len(shared)} node(s) shared their seeds in time, and at least {MIN_PARTICIPANTS} are needed",
            )
        self.shared = frozenset(shared)
        for node in sorted(shared):
            mine = {v: self.ciphertexts[v][node] for v in self.graph[node] if v in shared}
            out.append(c.SendSecAgg(node, self.key.round, SecAggShared(task_id=self.tasks[node], shares=mine)))
        self.phase, self.deadline = SecurePhase.MASKED, None
        return out_of_it, None

    def _needed(self, node: str) -> int:
        return self.settings.shares_needed(len(self.graph[node]))

    def send_unmask(self, out: list[c.Command], survivors: frozenset[str], now: float) -> str | None:
        """When the round closes: ask every survivor for the shares that remove the masks (None), or
        say why the sum cannot be unmasked (too few survivors, or a secret with too few holders left)."""
        if len(survivors) < MIN_PARTICIPANTS:
            return f"{len(survivors)} masked update(s) came in time, and at least {MIN_PARTICIPANTS} are needed"
        why = self._unreachable(survivors, lambda n: n in survivors)
        if why is not None:
            return why
        for node in sorted(survivors):
            mine = self.graph[node]
            asked = SecAggUnmask(
                task_id=self.tasks[node],
                survivors=tuple(v for v in mine if v in survivors),
                dropped=tuple(v for v in mine if v in self.shared and v not in survivors),
            )
            self.asked[node] = asked
            out.append(c.SendSecAgg(node, self.key.round, asked))
        self.phase, self.deadline = SecurePhase.UNMASK, now + self.timeout_s
        return None

    def _unreachable(self, survivors: frozenset[str], holds: Callable[[str], bool]) -> str | None:
        """Why some secret the sum needs has fewer than its threshold of holders for which `holds`."""
        for owner in sorted(self.shared):
            kind = "self-mask seed" if owner in survivors else "mask key"
            holders = sum(1 for v in self.graph[owner] if holds(v))
            needed = self._needed(owner)
            if holders < needed:
                return f"{owner}'s {kind} needs {needed} shares, and {holders} of its neighbours can give one"
        return None

    def unmask_due(self, now: float) -> bool:
        return self.phase == SecurePhase.UNMASK and (
            self.revealed >= set(self.asked) or (self.deadline is not None and now >= self.deadline)
        )

    def finish(self, survivors: frozenset[str]) -> tuple[SecureSum | None, str | None]:
        """After the unmask step: the material to unmask the sum, or why there is not enough of it."""
        self.phase, self.deadline = SecurePhase.DONE, None
        why = self._unreachable(survivors, self.revealed.__contains__)
        if why is not None:
            return None, f"{why} (after the reveals)"
        material = SecureSum(
            settings=self.settings,
            key=self.key,
            graph=dict(self.graph),
            shared=self.shared,
            public_keys={n: self.keys[n] for n in self.shared},
            commitments={n: self.commitments[n] for n in self.shared},
            seed_shares={n: dict(self.seed_shares.get(n, {})) for n in sorted(survivors)},
            key_shares={n: dict(self.key_shares.get(n, {})) for n in sorted(self.shared - survivors)},
            weight_total=self.weight_total,
        )
        return material, None
