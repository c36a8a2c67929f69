"""One way to run loops and one backoff, for every subsystem and for the process.

`Supervisor` runs named children, each a coroutine `run(stop)` that returns once `stop` is set. A child either
restarts after a failure (with `Backoff`, marked down in an optional `up` gauge, the others carry on) or, with
`restart=False`, ends the whole group: its siblings are cancelled and its error is re-raised to whoever awaits
`Supervisor.run`. A `FatalError` always ends the group and carries the process's exit code; only `agent.app`
turns it into one. After `stop` the children get `grace` seconds to finish before they are cancelled.

`Backoff` is the one capped exponential backoff (optionally jittered, as client-go does) that every retry loop
uses: the process supervisor, health producers, the device-plugin registration, remediation, drain, the
Kubernetes reflector, netacct and shaping syncs.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Gauge

from agent.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

RunFn = Callable[[asyncio.Event], Awaitable[None]]
OnFailure = Callable[[str, Exception, float], None]

EXIT_FAILURE = 1
EXIT_USAGE = 2


class FatalError(Exception):
    """A condition that ends the process (e.g. NVML required but missing); `exit_code` is the process's."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class StartupError(FatalError):
    """The configuration cannot run (no credentials for remediation, an unknown profile, a bad path): exit 2."""

    exit_code = EXIT_USAGE


class Backoff:
    """Capped exponential backoff: `initial`, twice that, ... up to `maximum`; `jitter` 0.2 spreads each by ±20%."""

    def __init__(self, initial: float = 1.0, maximum: float = 60.0, *, jitter: float = 0.0,
                 rng: random.Random | None = None) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {initial}, {maximum}")
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.delay = initial  # the next wait before jitter
        self.failures = 0  # since the last reset

    def next(self) -> float:
        """Count a failure: the seconds to wait now (jittered); the wait after it doubles, up to `maximum`."""
        wait = self.delay * (self._rng.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else 1.0)
        self.delay = min(self.delay * 2, self.maximum)
        self.failures += 1
        return wait

    def reset(self) -> None:
        """Success: the next failure waits `initial` again."""
        self.delay = self.initial
        self.failures = 0


@dataclass
class _Child:
    name: str
    run: RunFn
    restart: bool


def log_failure(name: str, exc: Exception, delay: float) -> None:
    """The default report of a failed child: the traceback, and when it restarts."""
    log.error("%s failed; the others keep running; restarting it in %.1fs", name, delay, exc_info=exc)


class Supervisor:
    """Runs named children until `stop`; see the module docstring for what happens when one fails."""

    def __init__(self, stop: asyncio.Event, *, clock: Clock = SYSTEM_CLOCK, initial: float = 1.0,
                 maximum: float = 60.0, grace: float = 10.0, up: Gauge | None = None,
                 on_failure: OnFailure = log_failure, restart_returned: bool = False) -> None:
        self.stop = stop
        self.clock = clock
        self.grace = grace
        self.up = up
        self.failures: dict[str, int] = {}
        self._initial = initial
        self._maximum = maximum
        self._on_failure = on_failure
        self._restart_returned = restart_returned  # a child that returns before stop is restarted, not done
        self._children: list[_Child] = []

    def add(self, name: str, run: RunFn, *, restart: bool = True) -> None:
        """Register a child before `run()`; `restart=False`: its failure ends the group and is re-raised."""
        self._children.append(_Child(name, run, restart))
        self.failures[name] = 0
        self._mark(name, False)  # the series exists from the first scrape on; 1 once the child runs

    def _mark(self, name: str, up: bool) -> None:
        if self.up is not None:
            self.up.labels(name).set(1 if up else 0)

    async def _guard(self, child: _Child) -> None:
        backoff = Backoff(self._initial, self._maximum)
        while not self.stop.is_set():
            self._mark(child.name, True)
            try:
                await child.run(self.stop)
            except FatalError:
                raise
            except Exception as exc:
                if not child.restart:
                    raise
                delay = backoff.next()
                self._on_failure(child.name, exc, delay)
            else:
                if self.stop.is_set() or not self._restart_returned:
                    return
                delay = backoff.next()
                log.error("%s returned before shutdown; restarting it in %.1fs", child.name, delay)
            self.failures[child.name] += 1
            self._mark(child.name, False)
            await self.clock.wait(self.stop, delay)

    async def run(self) -> None:
        """Run every child until `stop` (or until all have returned); re-raises a group-ending error."""
        tasks = [asyncio.create_task(self._guard(child), name=child.name) for child in self._children]
        try:
            await self._watch(tasks)
        except FatalError:
            self.stop.set()  # the end of the process: every child gets its grace to clean up
            await self._wind_down(tasks)
            raise
        except BaseException:
            await self._cancel(tasks)
            raise
        await self._wind_down(tasks)

    async def _watch(self, tasks: list[asyncio.Task[None]]) -> None:
        stopper = asyncio.ensure_future(self.stop.wait())
        running = set(tasks)
        try:
            while running and not self.stop.is_set():
                done, _ = await asyncio.wait({*running, stopper}, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {stopper}:
                    running.discard(task)
                    error = None if task.cancelled() else task.exception()
                    if error is not None:
                        raise error
        finally:
            stopper.cancel()
            await asyncio.gather(stopper, return_exceptions=True)

    async def _wind_down(self, tasks: list[asyncio.Task[None]]) -> None:
        pending = [task for task in tasks if not task.done()]
        if pending and self.grace > 0:
            _, late = await asyncio.wait(pending, timeout=self.grace)
            for task in late:
                log.warning("%s did not stop within %.0fs; cancelling it", task.get_name(), self.grace)
        await self._cancel(pending)
        for task in tasks:  # a child that failed while stopping still reports its error
            error = None if task.cancelled() else task.exception()
            if isinstance(error, FatalError):
                raise error

    @staticmethod
    async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
