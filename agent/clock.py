"""Time, injected: wall-clock seconds, monotonic seconds, and stoppable waits.

Every subsystem that waits or measures an interval takes a `Clock`, so tests drive health, the device plugin,
network accounting, remediation and the supervisor with one fake clock (tests/fakes/clock.py): an hour of
heartbeats, backoffs and Lease renewals runs in milliseconds, and every loop wakes at once when its stop event
is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time, monotonic time and interruptible sleep."""

    def now(self) -> float:
        """Epoch seconds (shared with other nodes through Lease and annotation timestamps)."""
        ...

    def monotonic(self) -> float:
        """Seconds from an arbitrary start that never go back: for intervals, deadlines and rates."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until `event` is set or `timeout` seconds pass; True if the event is set."""
        ...


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        """time.time()."""
        return time.time()

    def monotonic(self) -> float:
        """time.monotonic()."""
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """asyncio.wait_for on the event."""
        if event.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        return event.is_set()


SYSTEM_CLOCK = SystemClock()
