"""Waiting for asynchronous effects in tests: poll a predicate, fail loudly if it never holds.

The timeout is a guard against hangs, never a timing assertion: the figures live in bench/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], object], what: str = "condition", timeout: float = 20.0,
                interval: float = 0.005) -> None:
    """Return once `predicate()` is true; AssertionError naming `what` after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(interval)
