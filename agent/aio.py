"""The asyncio idioms every loop of the agent shares: wait that ends early on stop, and cancel-then-await.

Every loop takes a stop event; these helpers keep its waits stoppable and its shutdowns leak-free in one way:
a loop that waits for "this, or stop" says `await wait_any(stop, this)`, never a hand-written race.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less when `stop` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def wait_any(*waits: asyncio.Event | Awaitable[Any], timeout: float | None = None) -> None:
    """Return when any event is set or any awaitable has finished, or after `timeout` seconds.

    An awaitable is run as a task; the ones still pending on return are cancelled and awaited. One that
    finished keeps its result or exception for the caller to read (pass a task to read it); none is raised here.
    """
    waiters = [asyncio.ensure_future(wait.wait() if isinstance(wait, asyncio.Event) else wait) for wait in waits]
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
