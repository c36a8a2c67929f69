"""The one supervisor: a failing child is restarted and never takes the others down; stop ends everything;
a group-ending failure or a FatalError stops the siblings and is re-raised. Time is the fake clock's."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry, Gauge

from agent.supervisor import Backoff, FatalError, StartupError, Supervisor
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until


async def test_a_failing_subsystem_restarts_while_the_others_keep_running():
    stop = asyncio.Event()
    clock = FakeClock()
    registry = CollectorRegistry()
    up = Gauge("gpu_node_agent_subsystem_up", "up", ["subsystem"], registry=registry)
    supervisor = Supervisor(stop, clock=clock, up=up, initial=1.0, maximum=2.0, grace=1.0, restart_returned=True)
    ticks = {"healthy": 0}
    attempts = {"broken": 0}

    async def healthy(stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            ticks["healthy"] += 1
            await clock.wait(stop_event, 0.5)

    async def broken(stop_event: asyncio.Event) -> None:
        attempts["broken"] += 1
        raise RuntimeError("NVML exploded")

    supervisor.add("healthy", healthy)
    supervisor.add("broken", broken)
    runner = asyncio.create_task(supervisor.run())
    await until(lambda: attempts["broken"] == 1, "the first attempt")
    await clock.advance(0.9)
    assert attempts["broken"] == 1  # backing off: 1 s after the first failure
    await clock.advance(0.1)
    await until(lambda: attempts["broken"] == 2, "the first restart")
    await clock.advance(1.9)
    assert attempts["broken"] == 2  # the wait doubled
    await clock.advance(0.1)
    await until(lambda: attempts["broken"] == 3, "the second restart")
    before = ticks["healthy"]
    await clock.advance(1.0)
    await until(lambda: ticks["healthy"] > before, "the healthy child still running")  # after repeated failures
    assert registry.get_sample_value("gpu_node_agent_subsystem_up", {"subsystem": "healthy"}) == 1
    assert registry.get_sample_value("gpu_node_agent_subsystem_up", {"subsystem": "broken"}) == 0
    assert supervisor.failures["broken"] >= 3
    stop.set()
    await asyncio.wait_for(runner, 5)


async def test_a_subsystem_that_ignores_stop_is_cancelled_after_the_grace_period():
    stop = asyncio.Event()
    supervisor = Supervisor(stop, grace=0.05)
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def stubborn(stop_event: asyncio.Event) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    supervisor.add("stubborn", stubborn)
    runner = asyncio.create_task(supervisor.run())
    await asyncio.wait_for(started.wait(), 5)
    stop.set()
    await asyncio.wait_for(runner, 5)
    assert cancelled.is_set()


async def test_a_group_ending_child_cancels_its_siblings_and_re_raises():
    stop = asyncio.Event()
    supervisor = Supervisor(stop, clock=FakeClock(), grace=0.0)
    sibling_cancelled = asyncio.Event()

    async def sibling(stop_event: asyncio.Event) -> None:
        try:
            await stop_event.wait()
        except asyncio.CancelledError:
            sibling_cancelled.set()
            raise

    async def buggy(stop_event: asyncio.Event) -> None:
        raise KeyError("a bug")

    supervisor.add("sibling", sibling, restart=False)
    supervisor.add("buggy", buggy, restart=False)
    with pytest.raises(KeyError):
        await asyncio.wait_for(supervisor.run(), 5)
    assert sibling_cancelled.is_set() and not stop.is_set()  # the process's stop is not the group's to set


async def test_a_fatal_error_stops_everything_gracefully_and_carries_its_exit_code():
    stop = asyncio.Event()
    supervisor = Supervisor(stop, clock=FakeClock(), grace=5.0)
    cleaned = asyncio.Event()

    async def tidy(stop_event: asyncio.Event) -> None:
        await stop_event.wait()
        cleaned.set()  # stopped through `stop`, not cancelled: its cleanup ran

    async def fatal(stop_event: asyncio.Event) -> None:
        raise StartupError("no credentials")

    supervisor.add("tidy", tidy)
    supervisor.add("fatal", fatal)
    with pytest.raises(FatalError) as raised:
        await asyncio.wait_for(supervisor.run(), 5)
    assert raised.value.exit_code == 2 and stop.is_set() and cleaned.is_set()
    assert FatalError("x").exit_code == 1 and FatalError("x", 3).exit_code == 3


def test_backoff_doubles_up_to_its_cap_and_resets():
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.failures == 5 and backoff.delay == 3.0
    backoff.reset()
    assert (backoff.next(), backoff.failures) == (0.5, 1)


def test_backoff_jitter_stays_within_its_spread():
    backoff = Backoff(10.0, 10.0, jitter=0.2, rng=random.Random(1))  # noqa: S311 - jitter
    waits = [backoff.next() for _ in range(200)]
    assert all(8.0 <= w <= 12.0 for w in waits) and len(set(waits)) > 100


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_a_shape_that_would_spin_or_shrink(initial: float, maximum: float):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(initial, maximum)
