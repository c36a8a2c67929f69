"""The device-plugin subsystem as one object: every resource server, rescans, and device health.

The rest of the agent talks only to this: `start()`/`stop()`, `update_topology()` after a rescan (changed
device sets reach the kubelet through ListAndWatch; new resources start serving, vanished ones stop), health
events on an asyncio queue (a device can go Unhealthy and come back), and `registered` for readiness.

All servers of one manager share one `placement.joint.JointAllocator` (and so one admission context): serving GPUs
and NICs from one process is what lets the NIC call of a container see the GPUs it just got, and the other
way round. Its metrics go to the `registry` handed in (the agent's /metrics registry).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import CollectorRegistry

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.config.model import DevicePluginConfig
from agent.deviceplugin.metrics import AllocationMetrics
from agent.deviceplugin.payload import AllocateOptions
from agent.deviceplugin.pools import ResourcePool, build_pools, socket_name
from agent.deviceplugin.registration import KubeletLink, check_socket_path
from agent.deviceplugin.server import DevicePlugin, PreferencePolicy
from agent.events import DeviceHealthEvent
from agent.placement.admission import DEFAULT_TTL_S
from agent.placement.joint import JointAllocator
from agent.topology.model import Topology

log = logging.getLogger(__name__)


class DevicePluginManager:
    """Owns the per-resource DevicePlugin servers and their kubelet registration.

    `policy`: None for the PCIe-aware joint policy (`self.allocator.prefer`); another policy replaces it,
    while Allocates are still recorded and counted. `registry`: where the allocation metrics go (a private
    registry when None). `admission_ttl_s` and `clock`: the admission context's time-out and time source.
    """

    def __init__(self, config: DevicePluginConfig, topology: Topology, *,
                 health_events: asyncio.Queue[DeviceHealthEvent] | None = None,
                 poll_interval: float = 1.0, register_timeout: float = 10.0,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 policy: PreferencePolicy | None = None, registry: CollectorRegistry | None = None,
                 admission_ttl_s: float = DEFAULT_TTL_S, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.health_events: asyncio.Queue[DeviceHealthEvent] = health_events or asyncio.Queue()
        self._options = AllocateOptions.from_config(config)
        self._plugins: dict[str, DevicePlugin] = {}
        self.metrics = AllocationMetrics(registry)
        self.allocator = JointAllocator(self._plugins.values, ttl_s=admission_ttl_s, clock=clock.monotonic)
        self._policy = policy or self.allocator.prefer
        self._topology = topology
        self._link = KubeletLink(config.device_plugin_dir, poll_interval=poll_interval,
                                 register_timeout=register_timeout, backoff_initial=backoff_initial,
                                 backoff_max=backoff_max, clock=clock)
        self._unhealthy: dict[str, str] = {}  # device ID -> reason, across rescans and resources
        self._skipped: tuple[str, ...] = ()
        self._empty: tuple[str, ...] = ()
        self._health_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._started = False

    @property
    def registered(self) -> asyncio.Event:
        """Set while every served resource is registered with the running kubelet (readiness)."""
        return self._link.registered

    @property
    def registrations(self) -> int:
        """Successful Register calls so far."""
        return self._link.registrations

    @property
    def resources(self) -> list[str]:
        """Full names of the resources being served."""
        return sorted(self._plugins)

    def plugin(self, resource_name: str) -> DevicePlugin:
        """The servicer of one resource (KeyError when not served)."""
        return self._plugins[resource_name]

    def endpoint(self, resource_name: str) -> str:
        """Socket file name of a resource, relative to the device-plugin directory."""
        return socket_name(resource_name)

    def _scan(self, topology: Topology) -> dict[str, ResourcePool]:
        """Pools to serve: like SR-IOV DP, a pool without devices gets no server."""
        scan = build_pools(topology, self.config)
        if scan.skipped != self._skipped:
            self._skipped = scan.skipped
            if scan.skipped:
                log.warning("devices not served: %s", "; ".join(scan.skipped))
        empty = tuple(sorted(p.resource_name for p in scan.pools if not p.devices))
        if empty != self._empty:
            self._empty = empty
            if empty:
                log.info("no devices match %s; not serving %s", ", ".join(empty),
                         "it" if len(empty) == 1 else "them")
        return {name: pool for name, pool in scan.by_name().items() if pool.devices}

    def _new_plugin(self, pool: ResourcePool) -> DevicePlugin:
        plugin = DevicePlugin(pool, self._options, policy=self._policy, on_allocate=self.allocator.allocated,
                              metrics=self.metrics)
        self.metrics.add_resource(pool.resource_name)
        for device_id, reason in self._unhealthy.items():
            plugin.set_health(device_id, False, reason)
        return plugin

    async def start(self) -> None:
        """Validate the config, start every server and the registration loop and the health consumer.

        Raises PoolConfigError or SocketPathError for configurations that can never work.
        """
        async with self._lock:
            if self._started:
                return
            check_socket_path(f"{self.config.device_plugin_dir}/kubelet.sock")
            pools = self._scan(self._topology)
            for name in pools:
                check_socket_path(f"{self.config.device_plugin_dir}/{socket_name(name)}")
            for pool in pools.values():
                self._add(pool)
            self._started = True
            self._health_task = asyncio.create_task(self._consume_health(), name="device-health")
            await self._link.start()

    def _add(self, pool: ResourcePool) -> None:
        plugin = self._new_plugin(pool)
        self._plugins[pool.resource_name] = plugin
        self._link.add(plugin, socket_name(pool.resource_name))
        log.info("%s: serving %d devices", pool.resource_name, len(pool.devices))

    async def stop(self) -> None:
        """Stop the health consumer, the registration loop and every server; the sockets are removed."""
        async with self._lock:
            task, self._health_task = self._health_task, None
            if task is not None:
                await aio.cancel_and_wait(task)
            await self._link.stop()
            self._started = False

    async def update_topology(self, topology: Topology) -> None:
        """Serve a rescanned topology: device sets update streams, resources come and go."""
        async with self._lock:
            self._topology = topology
            if not self._started:
                return
            pools = self._scan(topology)
            for name in [n for n in self._plugins if n not in pools]:
                del self._plugins[name]
                await self._link.remove(name)
            for name, pool in pools.items():
                plugin = self._plugins.get(name)
                if plugin is None:
                    self._add(pool)
                    continue
                before = set(plugin.pool.ids)
                if plugin.update_pool(pool):
                    after = set(pool.ids)
                    log.info("%s: devices changed: %d added, %d removed, %d now", name, len(after - before),
                             len(before - after), len(after))

    def apply_health(self, event: DeviceHealthEvent) -> None:
        """Apply one health verdict to whichever resource has the device (remembered for later rescans)."""
        if event.healthy:
            self._unhealthy.pop(event.device_id, None)
        else:
            self._unhealthy[event.device_id] = event.reason
        for plugin in self._plugins.values():
            plugin.set_health(event.device_id, event.healthy, event.reason)

    async def _consume_health(self) -> None:
        while True:
            event = await self.health_events.get()
            try:
                self.apply_health(event)
            except Exception:
                log.exception("cannot apply health event %s", event)
            finally:
                self.health_events.task_done()
