"""The asyncio idioms every loop of the agent shares: wait that ends early on stop, and cancel-then-await.

Every loop takes a stop event; these helpers keep its waits stoppable and its shutdowns leak-free in one way.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less when `stop` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Return when any event is set, or after `timeout` seconds."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel_and_wait(*waiters)


async def cancel_and_wait(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel the tasks and wait until they have finished, whatever they raise (None entries are skipped)."""
    pending = [task for task in tasks if task is not None]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
