"""The algorithm half's heavy calls the engine asks for, off the event loop.

A part of the MQTT driver (`coordinator.drivers.mqtt`). Configure, aggregate, evaluate, rollback and
the checkpoint's snapshot run one after another on one worker thread (`Lane`), so the engine never
waits and the half never sees a half-updated model; each result comes back to the event loop as the
engine's event, and a call that raised as `Failed`, which ends the run with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fedmq.coordinator.drivers.outbox import Outbox
from fedmq.coordinator.engine import commands as c
from fedmq.coordinator.engine import events as e
from fedmq.coordinator.halfcalls import HalfCalls
from fedmq.coordinator.lane import Lane
from fedmq.coordinator.observers.reporting import Evaluator
from fedmq.coordinator.storage.persistence import Persistence
from fedmq.coordinator.storage.run_dir import RunDir

logger = logging.getLogger("fedmq.coordinator.drivers.mqtt")


class Failed(Exception):
    """A heavy call raised: the run fails with this as the reason."""


class HeavyCalls:
    def __init__(
        self,
        calls: HalfCalls,
        outbox: Outbox,
        evaluator: Evaluator,
        persistence: Persistence,
        run_dir: RunDir,
        post: Callable[[e.Event | Failed], None],
    ) -> None:
        """`post` hands each call's event (or its failure) to the daemon's queue; `outbox` encodes and
        keeps a configured step's frames."""
        self.calls = calls
        self.lane = Lane()
        self._outbox = outbox
        self._evaluator = evaluator
        self._persistence = persistence
        self._run_dir = run_dir
        self._post = post

    def configure(self, command: c.Configure) -> None:
        """The half's payload for the step's tasks, encoded in the lane (the model is read whole); the
        frames are kept on the event loop."""
        self._submit(
            lambda: self._outbox.encode(command, self.calls.configure(command)), "configure", self._outbox.keep
        )

    def aggregate(self, command: c.Aggregate) -> None:
        def aggregate() -> e.Aggregated:
            aggregated, records = self.calls.aggregate(command)
            for name, lines in records.items():
                self._run_dir.append_records(name, lines)
            return aggregated

        self._submit(aggregate, "aggregate")

    def evaluate(self, command: c.Evaluate) -> None:
        self._submit(lambda: e.Evaluated(command.step, self._evaluator()), "evaluate")

    def rollback(self) -> None:
        """In the lane, so that the next round's Configure (queued after it) reads the model it restores."""

        def done(_: Any, exc: BaseException | None) -> None:
            if exc is not None:
                logger.error("rollback failed: %r", exc, exc_info=exc)
                self._post(Failed(f"the algorithm's rollback failed: {exc!r}"))

        self.lane.submit(self.calls.rollback, done)

    def checkpoint(self, command: c.Checkpoint) -> None:
        """The snapshot is taken in the lane (between the half's calls); the writer puts it on disk."""

        def done(tensors: Any, exc: BaseException | None) -> None:
            if exc is None:
                self._persistence.submit(command.key, tensors, command.meta)
            else:
                logger.error("checkpoint snapshot failed: %r", exc)

        self.lane.submit(self._persistence.snapshot, done)

    async def close(self) -> None:
        """After the calls asked so far."""
        await self.lane.drain()
        self.lane.close()

    def _submit(self, call: Callable[[], Any], what: str, then: Callable[[Any], e.Event] | None = None) -> None:
        """Run `call` in the lane; its event (`then` makes it from the result, on the event loop), or
        the failure, goes to `post`."""

        def done(result: Any, exc: BaseException | None) -> None:
            if exc is None:
                self._post(then(result) if then is not None else result)
            else:
                logger.error("%s failed: %r", what, exc, exc_info=exc)
                self._post(Failed(f"the algorithm's {what} failed: {exc!r}"))

        self.lane.submit(call, done)
