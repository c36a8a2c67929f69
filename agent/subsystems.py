"""How each subsystem is built from the config and handed to the supervisor.

This is the one place that knows every subsystem; each gets the shared pieces (hardware, metrics registry,
readiness) and nothing else, and data flows one way: hardware -> topology -> consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent.app import Supervisor
from agent.config import AgentConfig
from agent.hardware import Hardware
from agent.http import Readiness
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.simulate.kubelet import LocalKubelet

log = logging.getLogger(__name__)

TopologyListener = Callable[[Topology], Awaitable[None]]


@dataclass
class Context:
    """What every subsystem may use."""

    cfg: AgentConfig
    hardware: Hardware
    registry: CollectorRegistry
    readiness: Readiness
    rescan: asyncio.Event
    scratch: Path
    topology_listeners: list[TopologyListener] = field(default_factory=list)
    device_plugin: DevicePluginManager | None = None


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def wait_any(*events: asyncio.Event, timeout: float) -> None:
    """Return when any event is set or after `timeout` seconds."""
    waiters = [asyncio.create_task(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)


async def run_rescans(ctx: Context, stop: asyncio.Event) -> None:
    """Rescan hardware on SIGHUP and on a slow timer; publish a changed topology to the listeners."""
    while not stop.is_set():
        await wait_any(stop, ctx.rescan, timeout=ctx.cfg.topology.rescan_interval_seconds)
        if stop.is_set():
            return
        requested = ctx.rescan.is_set()
        ctx.rescan.clear()
        before = ctx.hardware.topology
        topology = await asyncio.to_thread(ctx.hardware.rescan)
        if topology == before:
            log.log(logging.INFO if requested else logging.DEBUG, "rescan: hardware unchanged")
            continue
        log.info("rescan: hardware changed: %d GPUs, %d RDMA NICs, %d VFs", len(topology.gpus),
                 len(topology.rdma_nics), sum(len(n.vfs) for n in topology.rdma_nics))
        for listener in ctx.topology_listeners:
            try:
                await listener(topology)
            except Exception:
                log.exception("a subsystem failed to take the rescanned topology")


async def _show_sample_allocations(kubelet: LocalKubelet, resources: list[str]) -> None:
    """Simulate mode: admit a few containers through the stand-in kubelet and log what they got."""
    topology_note = "GPU+NIC" if len(resources) > 1 else "NIC only"
    for size in (1, 2, 4):
        request = dict.fromkeys(resources, size)
        try:
            allocation = await kubelet.admit(request)
        except Exception as exc:  # a demo must never take the agent down
            log.warning("sample allocation of %s failed: %s", request, exc)
            return
        log.info("sample allocation (%s, %d each): %s", topology_note, size,
                 {name: ids for name, ids in allocation.items()})
        kubelet.release(allocation)


def install_device_plugin(supervisor: Supervisor, ctx: Context) -> None:
    """Serve the device-plugin resources; in simulate mode bring a stand-in kubelet when none is there."""
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.simulate.kubelet import LocalKubelet

    cfg = ctx.cfg.device_plugin
    directory = Path(cfg.device_plugin_dir)
    stand_in = ctx.cfg.topology.simulate is not None and not (directory / "kubelet.sock").exists()
    if stand_in and not directory.is_dir():
        directory = ctx.scratch / "dp"
        directory.mkdir()
        cfg = dataclasses.replace(cfg, device_plugin_dir=str(directory))
    manager = DevicePluginManager(cfg, ctx.hardware.topology)
    ctx.device_plugin = manager
    ctx.readiness.require("device-plugin registered")

    async def on_topology(topology: Topology) -> None:
        await manager.update_topology(topology)

    ctx.topology_listeners.append(on_topology)

    async def run(stop: asyncio.Event) -> None:
        kubelet = LocalKubelet(directory) if stand_in else None
        if kubelet is not None:
            log.info("simulate mode: no kubelet at %s, starting a stand-in kubelet there", directory)
            await kubelet.start()
        shown = False
        try:
            await manager.start()
            while not stop.is_set():
                registered = manager.registered.is_set()
                ctx.readiness.set("device-plugin registered", registered)
                if registered and kubelet is not None and not shown:
                    shown = True
                    await _show_sample_allocations(kubelet, sorted(manager.resources))
                await _wait(stop, 0.5)
        finally:
            ctx.readiness.set("device-plugin registered", False)
            await manager.stop()
            if kubelet is not None:
                await kubelet.stop()

    supervisor.add("device-plugin", run)


def install(supervisor: Supervisor, ctx: Context) -> Context:
    """Add every enabled subsystem to the supervisor."""
    cfg = ctx.cfg
    if cfg.device_plugin.enabled:
        install_device_plugin(supervisor, ctx)
    supervisor.add("rescan", lambda stop: run_rescans(ctx, stop))
    return ctx
