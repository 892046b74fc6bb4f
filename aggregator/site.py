"""The aggregator's downstream half: the coordinator of one site's nodes, run a round at a time.

It is the coordinator daemon itself (the same MQTT adapter, validation, receipts, deadlines and run
directory) assembled with two other parts: the engine (`RelayRounds`: a round only when upstream
asks) and the half's calls (`RelayCalls`): the model the nodes receive is the one upstream sent, and
the round's accepted updates become one partial update (the method's `partial`) instead of a new model.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedmq.broker import BusConfig
from fedmq.coordinator.config import CoordinatorConfig
from fedmq.coordinator.drivers.mqtt import Coordinator, Summary, Watcher
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.engine.relay import RelayRounds
from fedmq.coordinator.halfcalls import HalfCalls, Records
from fedmq.fedcore.algorithms.base import CoordinatorHalf, Payload

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Partial:
    """What a site round sends upstream: the method's partial update of its accepted updates."""

    round: int
    payload: Payload
    num_samples: int
    """The sum of the accepted updates' counts: the weight upstream gives the partial."""
    nodes: tuple[str, ...]
    train_seconds: float
    """The longest training among them."""


class RelayCalls(HalfCalls):
    """The half's calls of a site: configure hands on upstream's model, aggregate makes the partial."""

    def __init__(self, half: CoordinatorHalf, config: CoordinatorConfig) -> None:
        super().__init__(half, config)
        self.model: tuple[int, Payload] | None = None
        """Upstream's payload and the site round it is for, set before the round is requested (read in the lane)."""
        self.partial: Partial | None = None
        """The last round's partial (written in the lane, read on the loop once the round has ended)."""

    def configure(self, command: c.Configure) -> Payload:
        if self.model is None or self.model[0] != command.ctx.round:
            raise RuntimeError(f"site round {command.ctx.round} has no model from upstream")
        return self.model[1]

    def aggregate(self, command: c.Aggregate) -> tuple[e.Aggregated, Records]:
        updates = command.updates
        payload, samples = self.half.partial(updates)
        self.partial = Partial(
            round=command.ctx.round,
            payload=payload,
            num_samples=samples,
            nodes=tuple(u.node_id for u in updates),
            train_seconds=max(u.train_seconds for u in updates),
        )
        return e.Aggregated(command.step, {"site_updates": len(updates), "site_samples": samples}), {}


def site_run_id(federation: str) -> str:
    """One run id for every aggregator worker of a site, so that the site's nodes follow any of them."""
    return hashlib.sha256(federation.encode()).hexdigest()[:16]


class SiteCoordinator:
    """The coordinator of a site's federation, driven by upstream's tasks (`request`): a `Coordinator`
    assembled with the relay engine and calls, whose round ends it watches (no override of its steps)."""

    def __init__(self, config: CoordinatorConfig, bus_config: BusConfig, half: CoordinatorHalf, *, site: str) -> None:
        self.site = site
        self.relay = RelayCalls(half, config)
        self.coordinator = Coordinator(
            config,
            bus_config,
            half,
            new_engine=lambda new_id: RelayRounds(config, half.update_schema(), new_id=new_id, stratum=site),
            calls=self.relay,
            run_id=site_run_id(config.federation),
        )
        self.coordinator.watchers.append(self._watch)
        self._waiting: dict[tuple[int, int], asyncio.Future[Partial | None]] = {}

    @property
    def engine(self) -> RelayRounds:
        engine = self.coordinator.engine
        assert isinstance(engine, RelayRounds)
        return engine

    @property
    def connected(self) -> asyncio.Event:
        """Set while the site's coordinator is connected to the site's broker."""
        return self.coordinator.connected

    @property
    def bus_config(self) -> BusConfig:
        return self.coordinator.bus_config

    @property
    def watchers(self) -> list[Watcher]:
        """The site coordinator's watchers (each event and its commands)."""
        return self.coordinator.watchers

    @property
    def capacity(self) -> int:
        """The samples of every node the site has heard of: the most a partial can claim, announced upstream."""
        return sum(n or 0 for n in self.engine.announced.values())

    @property
    def live(self) -> int:
        return len(self.engine.live)

    def request(
        self, round: int, attempt: int, settings: Mapping[str, Any], model: Payload
    ) -> asyncio.Future[Partial | None]:
        """Run a site round on upstream's `model`; the future gives its partial, or None when no update came."""
        key = (round, attempt)
        old = self._waiting.pop(key, None)
        if old is not None and not old.done():
            old.set_result(None)  # the same task twice (a redelivery): the newer request answers
        future: asyncio.Future[Partial | None] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self.relay.model = (round, model)
        self.coordinator.post(e.RoundRequested(round, attempt, dict(settings)))
        return future

    def finish(self, state: str) -> None:
        """Upstream's run ended: the site's ends with it, and its nodes are told."""
        self.coordinator.post(e.UpstreamFinished(state))

    def _watch(self, now: float, event: e.Event, commands: Sequence[c.Command]) -> None:
        for command in commands:
            if isinstance(command, c.RoundEnded):
                self._round_ended(command)

    def _round_ended(self, command: c.RoundEnded) -> None:
        future = self._waiting.pop((command.round, command.attempt), None)
        partial = self.relay.partial if command.aggregated else None
        self.relay.partial = None
        if partial is not None and partial.round != command.round:
            logger.error("site round %d ended with the partial of round %d; dropped", command.round, partial.round)
            partial = None
        if future is None or future.done():
            return
        future.set_result(partial)

    def _stop_waiting(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_result(None)
        self._waiting.clear()

    async def serve(self) -> Summary:
        """Serve the site's coordinator until upstream's run ends; a request still waiting then gets None."""
        try:
            return await self.coordinator.serve()
        finally:
            self._stop_waiting()
