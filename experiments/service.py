"""The daemons as services: systemd's notify protocol, waiting for the broker at start, and signals.

`Notifier` speaks sd_notify(3) without libsystemd: one datagram per message on the AF_UNIX socket
named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the abstract namespace). Without that variable
every call is a no-op, so the same daemon runs under systemd, Docker, supervisord or a shell. It says
READY=1 once the daemon is connected and subscribed, STATUS=... as its state changes, WATCHDOG=1
every half of ``$WATCHDOG_USEC`` while the event loop runs, and STOPPING=1 when it stops.

`wait_for_broker` is ``--connect-timeout``: at start, retry an unreachable broker with exponential
backoff and jitter until the timeout, then fail with a `BusError` naming the broker (exit code 3).

`Signals` is how a command stops: SIGINT interrupts (exit 130); SIGTERM drains a daemon (a node
finishes or abandons its task in hand and says goodbye, the coordinator checkpoints and writes its
summary; exit 0); a second SIGTERM, or a drain longer than its bound, stops the process at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from fedmq.broker import BusConfig
from fedmq.broker.errors import BusError

logger = logging.getLogger(__name__)

STATUS_EVERY_S = 5.0
"""How often STATUS= is refreshed (when it changed) where no watchdog asks for more often."""


def _address(value: str | None) -> str | None:
    """The socket address in $NOTIFY_SOCKET: a path, or '@name' for the abstract namespace."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    logger.warning("NOTIFY_SOCKET=%r is neither a path nor an abstract socket (@name); not notifying", value)
    return None


def _watchdog_s(environ: MutableMapping[str, str]) -> float | None:
    """The watchdog interval in $WATCHDOG_USEC, in seconds, when it is meant for this process."""
    usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    if not usec:
        return None
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        logger.warning("WATCHDOG_USEC=%r is not a whole number of microseconds; no watchdog pings", usec)
        return None
    return value / 1e6 if value > 0 else None


class Notifier:
    """sd_notify for one process. It reads (and, as sd_notify's ``unset_environment``, removes)
    NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID, so that processes it starts do not speak for it."""

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        environ = os.environ if environ is None else environ
        self.address = _address(environ.get("NOTIFY_SOCKET"))
        self.watchdog_s = _watchdog_s(environ) if self.address else None
        """The watchdog interval systemd enforces (WatchdogSec=), None without one; pings go at half of it."""
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
            environ.pop(name, None)
        self._status: str | None = None
        self._failed = False
        self.ready = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """One notification ("READY=1", "STATUS=..."); False when there is no socket or it failed."""
        if self.address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self.address)
                sock.sendall("\n".join(fields).encode())
        except OSError as exc:
            if not self._failed:  # said once: a watchdog ping every few seconds would flood the log
                logger.warning("cannot notify the service manager at %s: %s", self.address.lstrip("\0"), exc)
                self._failed = True
            return False
        return True

    def status(self, text: str) -> None:
        """STATUS=text, when it changed."""
        text = " ".join(text.split())  # one line: a newline would start another field
        if text != self._status:
            self._status = text
            self.send(f"STATUS={text}")

    def stopping(self, why: str) -> None:
        self._status = f"stopping: {why}"
        self.send("STOPPING=1", f"STATUS={self._status}")

    async def run(self, ready: Iterable[asyncio.Event], status: Callable[[], str]) -> None:
        """READY=1 once every event in `ready` is set; meanwhile and then, WATCHDOG=1 every half of the
        watchdog interval and STATUS=`status()` whenever it changed. Runs until cancelled.

        The pings are a timer by nature: each one says the event loop is still turning."""
        if not self.enabled:
            return
        events = list(ready)
        every = min(self.watchdog_s / 2, STATUS_EVERY_S) if self.watchdog_s else STATUS_EVERY_S
        waiting = asyncio.ensure_future(asyncio.gather(*(event.wait() for event in events)))
        try:
            while True:
                if not self.ready and waiting.done():
                    self.ready = True
                    self._status = " ".join(status().split())
                    self.send("READY=1", f"STATUS={self._status}")
                else:
                    self.status(status())
                if self.watchdog_s:
                    self.send("WATCHDOG=1")
                if self.ready:
                    await asyncio.sleep(every)
                else:  # ready as soon as the events say so, not at the next tick
                    await asyncio.wait({waiting}, timeout=every)
        finally:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting

    @contextlib.asynccontextmanager
    async def running(self, ready: Iterable[asyncio.Event], status: Callable[[], str]) -> AsyncIterator[None]:
        """`run` alongside the body; STOPPING=1 with the last status when the body ends."""
        task = asyncio.create_task(self.run(ready, status), name="sd-notify")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if self.enabled:
                self.stopping(status())


def coordinator_status(coordinator: Any, step_name: str) -> str:
    """The coordinator's STATUS= line: its state, the round (or model version), live nodes, accuracy."""
    fields = coordinator.engine.status().fields
    text = f"{coordinator.state}: {step_name} {fields.get('round', 0)}/{fields.get('rounds', '?')}"
    text += f", {fields.get('live_nodes', 0)} nodes live"
    if fields.get("accuracy") is not None:
        text += f", accuracy {fields['accuracy']:.4f}"
    return text


def nodes_status(daemons: list[Any]) -> str:
    """A node host's STATUS= line: how many of its nodes are connected, and the updates they sent."""
    connected = sum(d.connected.is_set() for d in daemons)
    text = f"{connected}/{len(daemons)} nodes connected, {sum(d.rounds_trained for d in daemons)} updates sent"
    return text + (", draining" if any(d.draining for d in daemons) else "")


def _why(exc: OSError) -> str:
    """An OSError in a few words: "Connection refused", "Name or service not known"."""
    if isinstance(exc, socket.gaierror) or not exc.errno:
        return exc.strerror or str(exc)
    return os.strerror(exc.errno)  # asyncio's own loop says "Connect call failed (address)" instead


async def wait_for_broker(
    config: BusConfig,
    timeout_s: float,
    *,
    initial_s: float = 0.25,
    max_s: float = 10.0,
    attempt_s: float = 5.0,
    on_retry: Callable[[int, str], None] | None = None,
    rng: random.Random | None = None,
    flag: str | None = "--connect-timeout",
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return once the broker accepts a TCP connection; until `timeout_s` has passed, retry with
    exponential backoff (from `initial_s`, doubling, capped at `max_s`), each wait drawn between half
    of it and all of it (jitter: many nodes restarted together do not knock all at once). 0 tries once.

    Raises `BusError` naming the broker and the last failure (and `flag`, the option that sets the
    timeout). Only reachability is checked: the daemon's own connection then speaks MQTT, TLS and
    credentials, and fails fast on those."""
    rng = rng or random.Random()
    deadline = clock() + timeout_s
    delay, attempts = initial_s, 0
    while True:
        attempts += 1
        try:
            async with asyncio.timeout(attempt_s):
                _, writer = await asyncio.open_connection(config.host, config.port)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            if attempts > 1:
                logger.info("broker %s reachable after %d attempts", config.url, attempts)
            return
        except TimeoutError:
            last = f"no answer in {attempt_s:g} s"
        except OSError as exc:
            last = _why(exc)
        remaining = deadline - clock()
        if remaining <= 0:
            waited = f"within {timeout_s:g} s ({attempts} attempts)" if attempts > 1 else "at the first attempt"
            longer = f", and {flag} SECONDS waits longer for it" if flag else ""
            raise BusError(
                f"broker {config.url} unreachable {waited}: {last}; is a broker running there? `fedmq broker`"
                f" starts one{longer}"
            )
        pause = min(delay * rng.uniform(0.5, 1.0), remaining)
        if attempts == 1:
            logger.warning("broker %s unreachable (%s); retrying for up to %g s", config.url, last, timeout_s)
        else:
            logger.debug("broker %s still unreachable (%s); next try in %.2f s", config.url, last, pause)
        if on_retry is not None:
            on_retry(attempts, last)
        await sleep(pause)
        delay = min(delay * 2, max_s)


class Signals:
    """How a command's task stops. SIGINT (Ctrl-C) cancels it: exit 130. SIGTERM, for a daemon
    (`drains`), calls `drain` (by default cancelling the task, which a daemon treats as a clean stop)
    and the command exits 0 once it has drained; a second SIGTERM, or a drain still going after
    `drain_s`, ends the process at once with `forced_exit`. For other commands SIGTERM is SIGINT."""

    def __init__(self, *, drains: bool, drain_s: float = 60.0, forced_exit: int = 130) -> None:
        self.drains = drains
        self.drain_s = drain_s
        self.forced_exit = forced_exit
        self.drain: Callable[[], None] | None = None
        """What SIGTERM does for a daemon (set by the command once its daemons exist)."""
        self.on_stop: Callable[[str], None] | None = None
        """Told why the process stops (the notifier's STOPPING=1)."""
        self.draining = False
        self.interrupted = False
        self._task: asyncio.Task[int] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def install(self, task: asyncio.Task[int]) -> None:
        self._task = task
        loop = asyncio.get_running_loop()
        for sig, handler in ((signal.SIGINT, self.interrupt), (signal.SIGTERM, self.terminate)):
            with contextlib.suppress(NotImplementedError):  # not on Windows' loops
                loop.add_signal_handler(sig, handler)

    @property
    def drained(self) -> bool:
        """The command stopped because SIGTERM asked it to drain (and nothing interrupted that)."""
        return self.draining and not self.interrupted

    def interrupt(self) -> None:
        self.interrupted = True
        self._tell("interrupted")
        if self._task is not None:
            self._task.cancel()

    def terminate(self) -> None:
        if not self.drains:
            self.interrupt()
            return
        if self.draining:
            self.force("a second SIGTERM during the drain")
            return
        self.draining = True
        logger.warning("SIGTERM: draining (at most %g s; a second SIGTERM stops at once)", self.drain_s)
        self._tell("draining (SIGTERM)")
        self._timer = asyncio.get_running_loop().call_later(
            self.drain_s, self.force, f"the drain took longer than {self.drain_s:g} s"
        )
        if self.drain is not None:
            self.drain()
        elif self._task is not None:
            self._task.cancel()

    def force(self, why: str) -> None:
        """Stop the process now: worker threads (training, aggregation) would hold it at exit."""
        logger.error("%s: stopping at once (exit %d)", why, self.forced_exit)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stderr.flush()
            sys.stdout.flush()
        os._exit(self.forced_exit)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _tell(self, why: str) -> None:
        if self.on_stop is not None:
            try:
                self.on_stop(why)
            except Exception:
                logger.exception("the stop hook failed")


PARENT_ENV = "FEDMQ_PARENT_PID"


def die_with_parent() -> None:
    """A process started by `fedmq run` ends with it, even when `fedmq run` is killed outright.

    Linux only (prctl PR_SET_PDEATHSIG); SIGINT then stops the daemon as Ctrl-C does (no drain: the
    run and its broker are gone). Elsewhere `fedmq run` still stops its children whenever it can run
    its own clean-up.
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG
    if str(os.getppid()) != parent:  # the parent died before the call above
        os.kill(os.getpid(), signal.SIGINT)
