"""`aio.wait_any`: the one way a loop waits for something or stop. Events and awaitables race; whichever
finishes first ends the wait; what is still pending is cancelled and awaited, so nothing leaks."""

from __future__ import annotations

import asyncio

import pytest

from agent import aio


async def test_an_awaitable_that_finishes_first_ends_the_wait_and_keeps_its_result():
    stop = asyncio.Event()
    answer = asyncio.ensure_future(asyncio.sleep(0.01, result=42))
    await asyncio.wait_for(aio.wait_any(stop, answer), 5)
    assert answer.result() == 42
    assert not stop.is_set()


async def test_stop_cancels_the_pending_awaitable_and_waits_for_it_to_finish():
    stop = asyncio.Event()
    cleaned = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # cleanup that needs the loop: wait_any must wait for it
            cleaned.set()

    task = asyncio.ensure_future(forever())
    asyncio.get_running_loop().call_later(0.01, stop.set)
    await asyncio.wait_for(aio.wait_any(stop, task), 5)
    assert task.cancelled() and cleaned.is_set()


async def test_a_coroutine_is_run_and_cancelled_like_a_task():
    stop = asyncio.Event()
    started = asyncio.Event()

    async def waits() -> None:
        started.set()
        await asyncio.Event().wait()

    stop.set()
    await asyncio.wait_for(aio.wait_any(stop, waits()), 5)  # no "coroutine was never awaited" left behind
    assert not asyncio.all_tasks() - {asyncio.current_task()}


async def test_a_failure_is_kept_on_the_task_for_its_owner_and_not_raised_by_the_wait():
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.ensure_future(fails())
    await asyncio.wait_for(aio.wait_any(asyncio.Event(), task), 5)
    with pytest.raises(RuntimeError, match="boom"):
        task.result()


async def test_the_timeout_still_ends_a_wait_on_nothing_ready():
    gate = asyncio.Event()
    slow = asyncio.ensure_future(asyncio.sleep(60))
    loop = asyncio.get_running_loop()
    began = loop.time()
    await aio.wait_any(gate, slow, timeout=0.05)
    assert 0.04 <= loop.time() - began < 5
    assert slow.cancelled()
