"""Plays one node's scenario script (`fednode.scenario.NodeScript`) in wall time, for the node daemon.

Time 0 is when the daemon starts serving. `ScriptPlayer.play` walks the availability transitions
and tells the daemon of each change; the daemon publishes the retained status and, going offline,
drops the work in hand. A scripted crash is simulated on a live connection: the node publishes its
offline status itself (as its goodbye does) and the TCP connection to the broker stays up, so the
coordinator sees the node leave exactly as after a real goodbye or the broker's will, and the
same daemon comes back at the next online transition. The script's `Faults.fail_at_round` is the
fault that really drops the connection.

Each stretch of being online is a *spell* (an `asyncio.Event`, set when the spell ends). Work
started in a spell is wanted while it lasts: the modelled compute and link sleeps (`hold`) end
early when it ends, and a daemon drops an update produced for an ended spell. Training already
running in a worker thread is not interrupted: it holds the workspace's model, so it finishes
and its result is discarded.

With the default script nothing here awaits, counts or logs anything that changes the daemon's
behaviour: every hold is 0 s and returns at once, every task is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from fedmq.fednode.scenario import NodeScript, Transition

logger = logging.getLogger(__name__)


class ScriptPlayer:
    """One node's scripted availability and task drops, with counts of what the script cost."""

    def __init__(self, script: NodeScript, node_id: str, *, log: logging.LoggerAdapter | None = None) -> None:  # type: ignore[type-arg]
        self.script = script
        self.node_id = node_id
        self.log: logging.Logger | logging.LoggerAdapter = log or logger  # type: ignore[type-arg]
        self.online = script.starts_online
        self.tasks_received = 0
        """Tasks received while online, dropped ones included: the k of `NodeScript.drops`."""
        self.dropped = 0
        self.ignored_offline = 0
        """Tasks that came while offline (a race: the coordinator sends none to an offline node)."""
        self.abandoned = 0
        """Updates not sent because the node went offline while producing them."""
        self._spell = asyncio.Event()

    @property
    def spell(self) -> asyncio.Event:
        """The current online spell; set once it ends."""
        return self._spell

    def admit(self, round: int) -> bool:
        """Whether the node takes a task that just came (counted); False: ignore it silently."""
        if not self.online:
            self.ignored_offline += 1
            self.log.debug("scenario: offline, ignoring the task for round %d", round)
            return False
        k = self.tasks_received
        self.tasks_received += 1
        if self.script.drops(self.node_id, k):
            self.dropped += 1
            self.log.info("scenario: dropping task %d (round %d)", k, round)
            return False
        return True

    async def hold(self, seconds: float, spell: asyncio.Event) -> bool:
        """Sleep `seconds` (modelled compute or transfer) unless `spell` ends first; whether the work
        begun in `spell` is still wanted. Awaits nothing when `seconds` is 0."""
        if seconds > 0 and not spell.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(spell.wait(), seconds)
        return not spell.is_set()

    async def play(self, started: float, change: Callable[[Transition], Awaitable[None]]) -> None:
        """Apply each transition at `started` + its time (monotonic clock), calling `change` after
        the state changed; a transition to the state the node is already in does nothing."""
        for transition in self.script.transitions:
            await asyncio.sleep(max(0.0, started + transition.at - time.monotonic()))
            if transition.online == self.online:
                continue
            self.online = transition.online
            if not transition.online:
                self._spell.set()
                self._spell = asyncio.Event()
            try:
                await change(transition)
            except Exception:  # a daemon never dies of one transition; the next one still comes
                self.log.exception("scenario: applying the transition at %g s failed", transition.at)

    def counts(self) -> dict[str, int]:
        return {
            "tasks": self.tasks_received,
            "dropped": self.dropped,
            "ignored_offline": self.ignored_offline,
            "abandoned": self.abandoned,
        }
