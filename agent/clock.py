"""Time for remediation, injected: wall-clock seconds for annotations and Leases, and stoppable waits.

Every wait in remediation goes through `Clock.wait`, so tests can run an hour of heartbeats, healthy windows
and Lease renewals in milliseconds with a fake clock, and so every loop wakes at once when its stop event is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time and interruptible sleep."""

    def now(self) -> float:
        """Epoch seconds (shared with other nodes through Lease and annotation timestamps)."""

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """Wait until `event` is set or `timeout` seconds pass; True if the event is set."""


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        """time.time()."""
        return time.time()

    async def wait(self, event: asyncio.Event, timeout: float) -> bool:
        """asyncio.wait_for on the event."""
        if event.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(timeout, 0.0))
        return event.is_set()
