"""Site rounds of a hierarchical federation: the synchronous round policy, run when asked from upstream.

A site aggregator is a node of the federation upstream and the coordinator of its site's nodes. Each
task it receives from upstream becomes one site round (`RoundRequested`): the same round and attempt
(so each node trains with the random stream it would draw in a flat federation), the upstream task's
training settings, a sample of the site's live nodes, the site's deadline. When the round closes the
engine says so (`RoundEnded`); its `Aggregate` command, which the aggregator executes, makes the
partial update that goes upstream instead of a new model. Between requests the engine idles
("gated"): it never waits for nodes, never retries (upstream decides that), never evaluates, and runs
until upstream's run ends (`UpstreamFinished`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.sync import SyncRounds
from fedmq.coordinator.sampler import Selection
from fedmq.fedcore.protocol import RunState

logger = logging.getLogger(__name__)

ENDLESS = 2**31 - 1
"""The `rounds` of a site's config: its rounds end when upstream's run does, not at a count."""


class RelayRounds(SyncRounds):
    """`SyncRounds`, but a round starts only when upstream asks for it, and ends in `RoundEnded`."""

    def __init__(self, *args: Any, stratum: str = "", **kwargs: Any) -> None:
        """`stratum` names the site's sampling stream: the site's name, the same in every run of the experiment."""
        kwargs["evaluates"] = False
        super().__init__(*args, **kwargs)
        self.stratum = stratum or self.config.federation
        self._requests: deque[e.RoundRequested] = deque()
        self._settings: Mapping[str, Any] = {}

    def handle(self, event: e.Event, now: float) -> list[c.Command]:
        """`SyncRounds`' commands, less its checkpoints (a site keeps nothing between rounds: upstream
        holds the model) and with the upstream task's settings in each `Configure`."""
        out: list[c.Command] = [x for x in super().handle(event, now) if not isinstance(x, c.Checkpoint)]
        if self._settings:  # the upstream task's settings, not this config's schedule, go to the nodes
            out = [dataclasses.replace(x, settings=self._settings) if isinstance(x, c.Configure) else x for x in out]
        return out

    def _start(self, out: list[c.Command], now: float) -> None:
        """Running at once: a site with no live node tells upstream it has nothing, without waiting."""
        self.started_at = now
        self.startup_s = 0.0
        self.state = RunState.RUNNING
        self.phase = "gated"
        out.append(self.status())
        self._next_request(out, now)

    def _on(self, out: list[c.Command], event: e.Event, now: float) -> None:
        if isinstance(event, e.RoundRequested):
            self._requested(out, event, now)
        elif isinstance(event, e.UpstreamFinished):
            self.state = RunState(event.state)
            out.append(c.Finish(self.state))
        else:
            super()._on(out, event, now)

    def _requested(self, out: list[c.Command], event: e.RoundRequested, now: float) -> None:
        self._requests.append(event)
        state = self.current
        if self.phase == "collecting" and state is not None and not state.closed:
            # upstream moved on (its round closed first): this one closes with what it has, and its
            # partial goes up for upstream's policy to take as late (or carry)
            logger.warning("site round %d closes early: upstream sent the task of round %d", state.round, event.round)
            self._close(out, state, state.close(self.live.__contains__), now)
        elif self.phase == "gated":
            self._next_request(out, now)

    def _next_request(self, out: list[c.Command], now: float) -> None:
        while self._requests and self.phase == "gated":
            request = self._requests.popleft()
            self.round, self.attempt, self._settings = request.round, request.attempt, request.settings
            if not self.live:
                logger.warning("site round %d: no live node at this site", request.round)
                out.append(c.RoundEnded(request.round, request.attempt, aggregated=False, accepted=0))
                continue
            self._carried = {}
            super()._start_attempt(out, now)

    def _select(self, live: list[str], stratum: str | None = None) -> Selection:
        """A site's own sample: its own stream, C x live rounded at random (`coordinator.sampler`)."""
        return super()._select(live, stratum=self.stratum)

    def _start_attempt(self, out: list[c.Command], now: float) -> None:
        """After a round: the next request, if one waits (never a retry of its own)."""
        self.phase = "gated"
        self._next_request(out, now)

    def _resume_waiting(self, out: list[c.Command], now: float) -> None:
        self._start_attempt(out, now)

    def _end_attempt(self, out: list[c.Command], now: float, *, aggregated: bool, last_try: bool) -> None:
        state = self.current
        accepted = len(state.updates) if state is not None else 0
        out.append(c.RoundEnded(self.round, self.attempt, aggregated=aggregated, accepted=accepted))
        super()._end_attempt(out, now, aggregated=aggregated, last_try=True)

    def status_fields(self) -> dict[str, Any]:
        return {"round": self.round, "rounds": None, "model_version": self.version}
