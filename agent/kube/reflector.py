"""One list/watch loop for every object the agent follows: the pods of its node and the node itself.

The client-go reflector pattern with the watch hygiene a 7,500-node DaemonSet needs (reference
node-remediation.md §7): list (or get) once, then watch from that version, asking for bookmarks and a jittered
5-10 minute `timeoutSeconds`; each next watch resumes from the last version seen (an event or a bookmark), so
a quiet node costs about 8 watch requests an hour and no lists. Only a 410 (the version was compacted away)
lists again, at once the first time and with backoff when 410s come in a row. Errors back off exponentially
with jitter (`agent.supervisor.Backoff`), honouring Retry-After; a server that closes watches at once is
treated as an error, not a reason to spin. `run` returns as soon as `stop` is set, cancelling an open watch.

The owner supplies what differs: how to list (and apply the listing), how to apply one event, and its logger.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from agent.aio import wait_any
from agent.clock import SYSTEM_CLOCK, Clock
from agent.kube.errors import ApiError, ApiGone
from agent.kube.model import WatchEvent
from agent.supervisor import Backoff

T = TypeVar("T")

WATCH_TIMEOUT = (300, 600)  # seconds; client-go picks 5-10 minutes at random per watch
MAX_BACKOFF = 300.0
QUICK_CLOSE = 1.0  # a watch that ends this fast having sent nothing counts as a failure

Relist = Callable[[], Awaitable[str]]
Watch = Callable[[str, int], AsyncIterator[WatchEvent[T]]]


class Reflector(Generic[T]):
    """Keeps one watched thing current: `relist()` reads it whole and returns its resourceVersion, `watch(version,
    timeout)` streams its changes into `on_event`. `what` names it in the log lines of the owner's `log`."""

    def __init__(self, what: str, relist: Relist, watch: Watch[T], on_event: Callable[[WatchEvent[T]], None], *,
                 log: logging.Logger, version: str = "", clock: Clock = SYSTEM_CLOCK,
                 rng: random.Random | None = None, timeout_range: tuple[int, int] = WATCH_TIMEOUT,
                 backoff: Backoff | None = None, relist_after_error: bool = False) -> None:
        self.what = what
        self._relist = relist
        self._watch = watch
        self._on_event = on_event
        self._log = log
        self.version = version  # where the next watch starts; empty: list first
        self.clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.timeout_range = timeout_range
        self.backoff = backoff or Backoff(1.0, MAX_BACKOFF, jitter=0.2, rng=self._rng)
        self.relists = 0
        # After a failed request, read the thing again before watching: for a single object that GET is cheap,
        # and its success is how the owner learns that the API server answers again (the node watch wakes the
        # remediation loop that way); a list of many objects keeps resuming its watch instead.
        self.relist_after_error = relist_after_error

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the thing current until `stop` is set; re-raises only a bug (API errors are retried)."""
        loop = asyncio.create_task(self._loop(stop), name=f"watch of {self.what}")
        await wait_any(stop, loop)
        error = None if loop.cancelled() else loop.exception()
        if error is not None:
            raise error

    async def _loop(self, stop: asyncio.Event) -> None:
        gone_streak = 0
        while not stop.is_set():
            try:
                if not self.version:
                    self.version = await self._relist()
                    self.relists += 1
                    if not gone_streak:  # the server answers again (a run of 410s keeps backing off)
                        self.backoff.reset()
                if await self._watch_once():
                    self.backoff.reset()
                    gone_streak = 0
                    continue
                raise ApiError(0, f"the watch of {self.what} closed at once")  # a broken proxy: do not spin
            except ApiGone:
                self.version = ""
                gone_streak += 1
                self._log.info("watch of %s expired (410); reading it again", self.what)
                if gone_streak == 1:
                    continue  # re-list at once; a second 410 in a row backs off below
                wait = self.backoff.next()
            except ApiError as exc:
                wait = max(self.backoff.next(), exc.retry_after or 0.0)
                self._log.warning("watch of %s failed: %s; retrying in %.0fs", self.what, exc, wait)
                if self.relist_after_error:
                    self.version = ""
            await self.clock.wait(stop, wait)

    async def _watch_once(self) -> bool:
        """One watch request; True when it made progress (an event, or it lasted a while)."""
        started = self.clock.monotonic()
        seen = False
        timeout = self._rng.randint(*self.timeout_range)
        async for event in self._watch(self.version, timeout):
            seen = True
            self.version = event.resource_version or self.version
            self._on_event(event)
        return seen or self.clock.monotonic() - started >= QUICK_CLOSE
