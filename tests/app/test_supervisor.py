"""The one supervisor: a failing child is restarted and never takes the others down; stop ends everything;
a group-ending failure or a FatalError stops the siblings and is re-raised."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Gauge

from agent.supervisor import Supervisor


async def test_a_failing_subsystem_restarts_while_the_others_keep_running():
    stop = asyncio.Event()
    registry = CollectorRegistry()
    up = Gauge("gpu_node_agent_subsystem_up", "up", ["subsystem"], registry=registry)
    supervisor = Supervisor(stop, up=up, initial=0.01, maximum=0.02, grace=1.0, restart_returned=True)
    ticks = {"healthy": 0}
    attempts = {"broken": 0}

    async def healthy(stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            ticks["healthy"] += 1
            await asyncio.sleep(0.005)

    async def broken(stop_event: asyncio.Event) -> None:
        attempts["broken"] += 1
        raise RuntimeError("NVML exploded")

    supervisor.add("healthy", healthy)
    supervisor.add("broken", broken)
    runner = asyncio.create_task(supervisor.run())
    for _ in range(500):
        if attempts["broken"] >= 3:
            break
        await asyncio.sleep(0.01)
    before = ticks["healthy"]
    await asyncio.sleep(0.05)
    assert ticks["healthy"] > before  # still running after repeated failures next door
    assert registry.get_sample_value("gpu_node_agent_subsystem_up", {"subsystem": "healthy"}) == 1
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
