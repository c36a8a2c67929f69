"""The one way tests wait for asynchronous effects: poll a predicate, fail loudly if it never holds.

The timeout is a guard against hangs, never a timing assertion: the figures live in bench/. Given a fake
clock, each poll also moves fake time by `step`, so loops that sleep on the clock make progress.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

from tests.fakes.clock import FakeClock


def _failure(predicate: Callable[[], object], what: str | None, timeout: float) -> AssertionError:
    """Names what was waited for: `what`, else the predicate's own source (a lambda reads as its condition)."""
    if what is None:
        try:
            source = " ".join(inspect.getsource(predicate).split())
            what = source[source.index("lambda"):] if "lambda" in source else source
        except (OSError, TypeError):
            what = repr(predicate)
    return AssertionError(f"never happened within {timeout:g} s: {what}")


async def until(predicate: Callable[[], object], what: str | None = None, timeout: float = 20.0,
                interval: float = 0.005, *, clock: FakeClock | None = None, step: float = 0.0) -> None:
    """Return once `predicate()` is true; AssertionError naming `what` (by default the predicate's source) after
    `timeout` real seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise _failure(predicate, what, timeout)
        if clock is not None and step > 0:
            await clock.advance(step)
        await asyncio.sleep(interval)


def until_blocking(predicate: Callable[[], object], what: str | None = None, timeout: float = 20.0,
                   interval: float = 0.005) -> None:
    """`until` for tests that drive threads, outside an event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise _failure(predicate, what, timeout)
        time.sleep(interval)
