"""The one fake clock of the test suite: time moves only when a test says so (`advance`).

It implements `agent.clock.Clock` (wall time, monotonic time, stoppable waits), so the same instance drives
remediation, the supervisor, the reflector, health, the device plugin and network accounting in a test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class FakeClock:
    """`Clock` with manual time: `wait` blocks until `advance` passes its deadline or its event is set."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        """Moves with `now` (never back): fake time has no wall-clock steps."""
        return self._now

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        if event.is_set():
            return True
        if timeout <= 0:
            await asyncio.sleep(0)
            return event.is_set()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (self._now + timeout, future)
        self._sleepers.append(entry)
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({future, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            with contextlib.suppress(ValueError):
                self._sleepers.remove(entry)
        return event.is_set()

    def next_deadline(self) -> float | None:
        return min((d for d, f in self._sleepers if not f.done()), default=None)

    async def advance(self, seconds: float, settle: Callable[[], Awaitable[None]] | None = None) -> None:
        """Move time forward, waking sleepers in deadline order and letting the system settle after each."""
        target = self._now + seconds
        while True:
            due = [d for d, f in self._sleepers if not f.done() and d <= target]
            if not due:
                self._now = target
                if settle is not None:
                    await settle()
                return
            self._now = max(self._now, min(due))
            for deadline, future in list(self._sleepers):
                if deadline <= self._now and not future.done():
                    future.set_result(None)
            if settle is not None:
                await settle()
            else:
                await asyncio.sleep(0)
