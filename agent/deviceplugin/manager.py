"""The device-plugin subsystem as one object: every resource server, rescans, and device health.

The rest of the agent talks only to this: `start()`/`stop()`, `update_topology()` after a rescan (changed
device sets reach the kubelet through ListAndWatch; new resources start serving, vanished ones stop), device
health read from its one owner (`device_health`, an `agent.signals.DeviceHealth` the health subsystem writes: a
device can go Unhealthy and come back, and its health survives rescans), and `registered` for readiness.

All servers of one manager share one `placement.joint.JointAllocator` (and so one admission context): serving GPUs
and NICs from one process is what lets the NIC call of a container see the GPUs it just got, and the other
way round. Its metrics go to the `registry` handed in (the agent's /metrics registry).

Pools are built, indexed and compared with the served ones in a worker thread (1024 replicas of 28 MIG devices:
~0.1 s), then swapped in on the loop; a rescan whose topology and config are those the pools were built from
builds nothing (issue 37: no turn of the event loop over ~20 ms of CPU).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.config.model import DevicePluginConfig
from agent.deviceplugin.cdi import SPEC_DIRS, RdmaSpecWriter, find_spec, remove_stale_specs
from agent.deviceplugin.devinfo import DeviceInfoWriter
from agent.deviceplugin.metrics import AllocationMetrics
from agent.deviceplugin.nvidia import MIG_MINORS
from agent.deviceplugin.payload import AllocateOptions
from agent.deviceplugin.pluginwatcher import PLUGIN_WATCHER, PluginWatcherLink, resolve_mode
from agent.deviceplugin.pools import PoolScan, ResourcePool, build_pools, socket_name
from agent.deviceplugin.registration import KubeletLink, check_socket_path
from agent.deviceplugin.server import DevicePlugin, PreferencePolicy
from agent.deviceplugin.sriovdp import apply as apply_sriov_dp_config
from agent.host.unixsocket import SocketPathError
from agent.placement.admission import DEFAULT_TTL_S
from agent.placement.joint import JointAllocator
from agent.signals import DeviceHealth
from agent.topology.model import Topology

if TYPE_CHECKING:  # the kubelet's facts (agent.ownership) are imported only where ownership is wired
    from agent.deviceplugin.facts import OwnershipFacts
    from agent.ownership.service import OwnershipService

log = logging.getLogger(__name__)

NOT_SERVED_REASONS = ("not_ready", "mig", "mig_strategy", "default_route", "no_uuid")
# node paths shared with the DRA driver; set by --plugin-registry-dir and --cdi-spec-dir (config section `dra`)
DEFAULT_PLUGIN_REGISTRY_DIR = "/var/lib/kubelet/plugins_registry"
DEFAULT_CDI_SPEC_DIR = "/var/run/cdi"


@dataclass(frozen=True)
class _Change:
    """How a rebuilt pool's devices differ from those of `old`, the pool served when it was built."""

    old: ResourcePool
    devices_changed: bool
    added: int = 0
    removed: int = 0


def _compare(old: ResourcePool, new: ResourcePool) -> _Change:
    if new.devices == old.devices:
        return _Change(old, False)
    before, after = set(old.ids), set(new.ids)
    return _Change(old, True, len(after - before), len(before - after))


def _build(topology: Topology, config: DevicePluginConfig,
           served: dict[str, ResourcePool]) -> tuple[PoolScan, dict[str, _Change]]:
    """In a worker thread: the pools of `topology`, with the indexes the loop reads (IDs, by ID, by physical
    device) built here rather than at the first call that needs them, and each compared with the pool of that
    name `served` now. Reads only immutable pools and what it builds."""
    scan = build_pools(topology, config)
    changes = {}
    for pool in scan.pools:
        if pool.devices:
            pool.indexed()
            if (old := served.get(pool.resource_name)) is not None:
                changes[pool.resource_name] = _compare(old, pool)
    return scan, changes


class DevicePluginManager:
    """Owns the per-resource DevicePlugin servers and their kubelet registration.

    `plugin_registry_dir`, `cdi_spec_dir`: the kubelet plugin watcher's and the runtime's CDI directories (node
    paths the DRA driver shares). `policy`: None for the PCIe-aware joint policy (`self.allocator.prefer`);
    another policy replaces it, while Allocates are still recorded and counted. `registry`: where the allocation
    metrics go (a private registry when None). `admission_ttl_s` and `clock`: the admission context's time-out
    and time source. `ownership`: the kubelet's facts to place with (`facts.OwnershipFacts` on the served pools):
    each preference call looks up the container's partner devices, and the other kind's free devices come from
    the kubelet's last reading; None places on the admission context alone.
    """

    def __init__(self, config: DevicePluginConfig, topology: Topology, *,
                 device_health: DeviceHealth | None = None,
                 poll_interval: float = 1.0, register_timeout: float = 10.0,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0,
                 policy: PreferencePolicy | None = None, registry: CollectorRegistry | None = None,
                 admission_ttl_s: float = DEFAULT_TTL_S, clock: Clock = SYSTEM_CLOCK,
                 plugin_registry_dir: str = DEFAULT_PLUGIN_REGISTRY_DIR,
                 cdi_spec_dir: str = DEFAULT_CDI_SPEC_DIR, mig_minors: str = MIG_MINORS,
                 ownership: OwnershipService | None = None) -> None:
        config = apply_sriov_dp_config(config)  # SriovConfigError (a PoolConfigError) when it cannot be served
        self.config = config
        self.device_health = device_health if device_health is not None else DeviceHealth()
        self._options = AllocateOptions.from_config(config, mig_minors)
        self.device_info = DeviceInfoWriter(config.device_info_dir) if config.device_info_dir else None
        self.cdi_spec_dir = cdi_spec_dir
        self.rdma_specs = RdmaSpecWriter(cdi_spec_dir, config.rdma_mad_devices) if config.rdma_cdi else None
        self._plugins: dict[str, DevicePlugin] = {}
        self.metrics = AllocationMetrics(registry)
        self.not_served = Gauge("gpu_node_agent_devices_not_served",
                                "Devices found but not advertised, by reason (not_ready: VF without driver, RDMA "
                                "device or known link; mig: a MIG device, or a MIG-mode GPU without one, that the "
                                "MIG strategy does not serve; mig_strategy: GPUs held back on a node that breaks "
                                "mig-strategy single; default_route; no_uuid)",
                                ["reason"], registry=self.metrics.registry)
        for reason in NOT_SERVED_REASONS:
            self.not_served.labels(reason).set(0)
        self.facts: OwnershipFacts | None = None
        if ownership is not None:
            from agent.deviceplugin.facts import OwnershipFacts

            self.facts = OwnershipFacts(ownership, self.pools, config.gpu_resource_name)
        self.allocator = JointAllocator(self._plugins.values, ttl_s=admission_ttl_s, clock=clock.monotonic)
        self.allocator.replica_policy = config.shared_devices_allocation_policy
        self._policy = policy or self.allocator.prefer
        self._policy_lock = asyncio.Lock()  # one policy state, so one lock for all servicers (see server.py)
        self._topology = topology
        self.registration_mode = resolve_mode(config.registration_mode, plugin_registry_dir)
        self._link: KubeletLink | PluginWatcherLink
        if self.registration_mode == PLUGIN_WATCHER:
            self._link = PluginWatcherLink(plugin_registry_dir, poll_interval=poll_interval, clock=clock)
        else:
            self._link = KubeletLink(config.device_plugin_dir, poll_interval=poll_interval,
                                     register_timeout=register_timeout, backoff_initial=backoff_initial,
                                     backoff_max=backoff_max, clock=clock)
        self._skipped: tuple[str, ...] = ()
        self._empty: tuple[str, ...] = ()
        self._unshared: tuple[str, ...] = ()
        self._health_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._started = False
        # the topology and config the served pools were built from: the pools are a function of these two
        self._built_from: tuple[Topology, DevicePluginConfig] | None = None
        # at construction: `run` exits 2, never a crash loop; names only, no replicas (see build_pools)
        self._check_socket_paths({p.resource_name: p for p in build_pools(topology, config, expand=False).pools
                                  if p.devices})

    @property
    def registered(self) -> asyncio.Event:
        """Set while every served resource is registered with the running kubelet (readiness)."""
        return self._link.registered

    @property
    def registrations(self) -> int:
        """Successful Register calls so far."""
        return self._link.registrations

    def pools(self) -> list[ResourcePool]:
        """The pools being served now (they change on rescans)."""
        return [plugin.pool for plugin in self._plugins.values()]

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

    async def _scan(self, topology: Topology) -> tuple[dict[str, ResourcePool], dict[str, _Change]]:
        """Pools to serve (like SR-IOV DP, a pool without devices gets no server) and how each differs from the
        pool served now. Built in a worker thread: 1024 replicas of 28 MIG devices take ~0.1 s to build, index and
        compare; only the logging and the metrics are left to the loop."""
        served = {name: plugin.pool for name, plugin in self._plugins.items()}
        config = self.config
        scan, changes = await asyncio.to_thread(_build, topology, config, served)
        self._built_from = (topology, config)
        for reason in NOT_SERVED_REASONS:
            self.not_served.labels(reason).set(scan.not_served.get(reason, 0))
        if scan.skipped != self._skipped:
            self._skipped = scan.skipped
            if scan.skipped:
                log.warning("devices not served: %s", "; ".join(scan.skipped))
        self._say_unshared(scan.by_name())
        empty = tuple(sorted(p.resource_name for p in scan.pools if not p.devices))
        if empty != self._empty:
            self._empty = empty
            if empty:
                log.info("no devices match %s; not serving %s", ", ".join(empty),
                         "it" if len(empty) == 1 else "them")
        return {name: pool for name, pool in scan.by_name().items() if pool.devices}, changes

    def _say_unshared(self, pools: dict[str, ResourcePool]) -> None:
        """Once per change: time-sliced resources that this node does not serve (a typo, or a MIG profile absent
        here). NVIDIA's plugin skips them silently."""
        sharing = self.config.time_slicing
        unshared: tuple[str, ...] = ()
        if self.config.serve_gpus:
            served = {name for name, pool in pools.items() if pool.replicated}
            unshared = tuple(r.name for r in sharing.resources if sharing.served_name(r.name) not in served)
        if unshared != self._unshared:
            self._unshared = unshared
            if unshared:
                log.warning("timeSlicing: %s %s not served on this node; nothing to replicate", ", ".join(unshared),
                            "is" if len(unshared) == 1 else "are")

    def _new_plugin(self, pool: ResourcePool) -> DevicePlugin:
        plugin = DevicePlugin(pool, self._options, policy=self._policy, on_allocate=self.allocator.allocated,
                              metrics=self.metrics, device_info=self.device_info, device_health=self.device_health,
                              partner_lookup=self.facts.partner if self.facts is not None else None,
                              policy_lock=self._policy_lock, policy_reads=self._served_ids)
        self.metrics.add_resource(pool.resource_name)
        return plugin

    def _served_ids(self) -> int:
        """Devices served by all this manager's resources: what its shared policy may read in one call."""
        return sum(len(plugin.pool.devices) for plugin in self._plugins.values())

    async def start(self) -> None:
        """Validate the config, start every server and the registration loop and the health consumer.

        Raises PoolConfigError or SocketPathError for configurations that can never work.
        """
        async with self._lock:
            if self._started:
                return
            pools, _ = await self._scan(self._topology)
            self._check_socket_paths(pools)
            self._check_gpu_cdi(pools)
            for stale in remove_stale_specs(self.cdi_spec_dir):
                log.info("removed the CDI spec %s an earlier run left", stale)
            for pool in pools.values():
                self._add(pool)
            self._started = True
            self._health_task = asyncio.create_task(self._consume_health(), name="device-health")
            await self._link.start()

    def _check_socket_paths(self, pools: dict[str, ResourcePool]) -> None:
        """SocketPathError when the kubelet's socket or a served resource's socket would pass the AF_UNIX limit."""
        check_socket_path(f"{self.config.device_plugin_dir}/kubelet.sock")
        for name in pools:
            check_socket_path(f"{self._link.directory}/{socket_name(name)}")

    def _write_spec(self, pool: ResourcePool) -> None:
        if self.rdma_specs is None:
            return
        try:
            self.rdma_specs.write(pool)
        except OSError as exc:  # the runtime will refuse containers naming these devices; say why
            log.error("%s: cannot write CDI spec %s: %s", pool.resource_name, self.rdma_specs.path(pool),
                      exc.strerror or exc)

    def _check_gpu_cdi(self, pools: dict[str, ResourcePool]) -> None:
        serving = self._options.gpu
        if not serving.any_cdi or not any(p.kind == "gpu" for p in pools.values()):
            return
        if find_spec(serving.cdi_kind, (*SPEC_DIRS, self.cdi_spec_dir)) is None:
            log.warning("no CDI spec of kind %s in %s: containers given GPUs by CDI name will not start; run "
                        "`nvidia-ctk cdi generate` on the node or set --gpu-cdi-kind", serving.cdi_kind,
                        ", ".join(dict.fromkeys((*SPEC_DIRS, self.cdi_spec_dir))))

    def _add(self, pool: ResourcePool) -> None:
        self._write_spec(pool)
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
            if self.device_info is not None:
                self.device_info.remove_all()
            if self.rdma_specs is not None:
                self.rdma_specs.remove_all()
            self._started = False

    async def update_topology(self, topology: Topology) -> None:
        """Serve a rescanned topology: device sets update streams, resources come and go."""
        async with self._lock:
            self._topology = topology
            if not self._started:
                return
            if self._built_from is not None and self._built_from == (topology, self.config):
                return  # a rescan that found nothing new: nothing to build or compare
            pools, changes = await self._scan(topology)
            for name in [n for n in self._plugins if n not in pools]:
                del self._plugins[name]
                await self._link.remove(name)
                if self.device_info is not None:
                    self.device_info.retain(name, ())
                if self.rdma_specs is not None:
                    self.rdma_specs.remove(name)
            for name, pool in pools.items():
                plugin = self._plugins.get(name)
                if plugin is None:
                    try:
                        check_socket_path(f"{self._link.directory}/{socket_name(name)}")
                    except SocketPathError as exc:  # a resource new since the start (a MIG profile): not served
                        log.error("%s: not served: %s", name, exc)
                        continue
                    self._add(pool)
                    continue
                change = changes.get(name)
                if change is None or plugin.pool is not change.old:  # not compared in the thread: compare here
                    change = _compare(plugin.pool, pool)
                if change.devices_changed:
                    if self.device_info is not None:
                        self.device_info.retain(name, pool.ids)
                    self._write_spec(pool)  # before the kubelet can allocate a new device by its CDI name
                if plugin.update_pool(pool, change.devices_changed):
                    log.info("%s: devices changed: %d added, %d removed, %d now", name, change.added,
                             change.removed, len(pool.devices))

    async def _consume_health(self) -> None:
        """Tell the servers which devices flipped, so their ListAndWatch streams send a new list."""
        seen = self.device_health.version
        while True:
            version = await self.device_health.wait_newer(seen)
            flips = self.device_health.since(seen)
            seen = version
            for plugin in list(self._plugins.values()):
                try:
                    plugin.health_changed(flips)
                except Exception:
                    log.exception("%s: cannot apply device health changes", plugin.resource_name)
