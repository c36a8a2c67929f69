"""The composition root: builds each subsystem from the opened node and returns it; `agent.app` runs what it returns.

The node comes opened from `agent.node` (the config with the mode's defaults resolved, the hardware, the node
paths, the stand-in kubelet decision): nothing here tells a simulated node from a real one again.

Each builder takes exactly what its subsystem needs as arguments and returns values (a `Subsystem` to
supervise, the service object), so tests build one subsystem alone. `build` builds them in the order data flows
(the stand-in kubelet -> ownership -> device plugin -> DRA -> health -> remediation -> netacct -> shaping ->
rescans) and hands each its collaborators when it is built: nothing is set on a subsystem after its construction.
The builders of the subsystems that watch the node and its network (health, node labels, netacct, shaping) and
`Subsystem` itself live beside this module in `agent.subsystems`; their names are imported here as well.
Startup problems (no credentials, a socket path over the limit) are raised as `agent.supervisor.StartupError`,
which the process turns into one log line and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.config import AgentConfig
from agent.config.model import RESCAN_FLOOR_S
from agent.hardware import Hardware
from agent.http import Readiness
from agent.kube.access import ClusterPort
from agent.node import Node
from agent.signals import DeviceHealth, GpuResetListener, Latest, NodeVerdict
from agent.subsystems import (
    Subsystem,
    TopologyListener,
    health,
    netacct,
    node_labels,
    run_keeping_kernel_state,
    shaping,
)
from agent.supervisor import StartupError
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.dra.service import DraService
    from agent.kube.port import Cluster
    from agent.netacct.service import NetacctService
    from agent.ownership.service import OwnershipService
    from agent.ownership.subsystem import OwnershipSubsystem
    from agent.remediation import RemediationService
    from agent.remediation.isolate import PodsOf
    from agent.remediation.preflight import PreflightCheck
    from agent.shaping.service import ShapingService
    from agent.simulate.kubelet import LocalKubelet

log = logging.getLogger(__name__)


def rescans(hardware: Hardware, rescan: asyncio.Event, interval: float,
            listeners: Sequence[TopologyListener], registry: CollectorRegistry | None = None) -> Subsystem:
    """Rescan hardware on SIGHUP (`rescan`) and on a slow timer; publish a changed topology to `listeners`.

    A full rescan (a sysfs walk and NVML) starts at most once per RESCAN_FLOOR_S, whatever asks for it: the
    interval has that floor in config, and SIGHUPs within it are coalesced into one rescan at its end.
    """
    from prometheus_client import Counter

    done = Counter("gpu_node_agent_hardware_rescans", "Full hardware rescans (timer and SIGHUP; at most one a "
                   "second)", registry=registry)

    async def run(stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        last = -RESCAN_FLOOR_S
        while not stop.is_set():
            await aio.wait_any(stop, rescan, timeout=interval)
            wait = last + RESCAN_FLOOR_S - loop.time()
            if wait > 0 and not stop.is_set():
                await aio.sleep_or_stop(stop, wait)
            if stop.is_set():
                return
            requested = rescan.is_set()
            rescan.clear()
            last = loop.time()
            before = hardware.topology
            topology = await asyncio.to_thread(hardware.rescan)
            done.inc()
            if topology == before:
                log.log(logging.INFO if requested else logging.DEBUG, "rescan: hardware unchanged")
                continue
            log.info("rescan: hardware changed: %d GPUs, %d RDMA NICs, %d VFs", len(topology.gpus),
                     len(topology.rdma_nics), sum(len(n.vfs) for n in topology.rdma_nics))
            for listener in listeners:
                try:
                    await listener(topology)
                except Exception:
                    log.exception("a subsystem failed to take the rescanned topology")

    return Subsystem("rescan", run)


def stand_in_kubelet(node: Node) -> LocalKubelet | None:
    """On a simulated node without a kubelet, a stand-in kubelet in the directories `agent.node` chose for it
    (the device plugin starts it and registers with it; device ownership reads its records); else None."""
    from agent.simulate.kubelet import LocalKubelet

    if not node.paths.stand_in or not node.serving.device_plugin.enabled:
        return None
    node.paths.device_plugin_dir.mkdir(parents=True, exist_ok=True)
    return LocalKubelet(node.paths.device_plugin_dir)


def device_plugin(node: Node, registry: CollectorRegistry, *, readiness: Readiness, device_health: DeviceHealth,
                  kubelet: LocalKubelet | None = None, ownership: OwnershipService | None = None,
                  clock: Clock = SYSTEM_CLOCK) -> tuple[DevicePluginManager, Subsystem]:
    """Serve the device-plugin resources, placing with the kubelet's facts from `ownership` when given; with the
    stand-in `kubelet`, start it first, stop it last and admit a few sample containers through it."""
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.deviceplugin.pools import PoolConfigError
    from agent.host.unixsocket import SocketPathError
    from agent.simulate.samples import show_sample_allocations

    dp, paths, hardware = node.device_plugin_config(), node.paths, node.hardware
    try:
        manager = DevicePluginManager(dp, hardware.topology, device_health=device_health, registry=registry,
                                      clock=clock, plugin_registry_dir=str(paths.plugin_registry_dir),
                                      cdi_spec_dir=str(paths.cdi_spec_dir), mig_minors=hardware.mig_minors,
                                      ownership=ownership)
    except (SocketPathError, PoolConfigError) as exc:  # PoolConfigError: the SR-IOV DP config.json
        raise StartupError(f"device plugin: {exc}") from exc
    readiness.require("device-plugin registered")

    async def run(stop: asyncio.Event) -> None:
        if kubelet is not None:
            log.info("simulate mode: no kubelet at %s, starting a stand-in kubelet there", paths.device_plugin_dir)
            await kubelet.start()
        samples: asyncio.Task[None] | None = None
        try:
            await manager.start()
            while not stop.is_set():
                registered = manager.registered.is_set()
                readiness.set("device-plugin registered", registered)
                if registered and kubelet is not None and samples is None:
                    samples = asyncio.create_task(show_sample_allocations(kubelet, manager, hardware.topology))
                await clock.wait(stop, 0.5)
        finally:
            readiness.set("device-plugin registered", False)
            await aio.cancel_and_wait(samples)  # a demo must never hold up shutdown
            await manager.stop()
            if kubelet is not None:
                await kubelet.stop()

    return manager, Subsystem("device-plugin", run, manager.update_topology)


def dra(node: Node, registry: CollectorRegistry, *, cluster: ClusterPort,
        verdicts: Latest[NodeVerdict] | None = None) -> tuple[DraService, Subsystem]:
    """The DRA driver: this node's ResourceSlices and the kubelet DRA plugin, in the directories `agent.node` chose
    (the scratch directory on a simulated node without kubelet directories)."""
    from agent.dra.service import DraService
    from agent.host.unixsocket import SocketPathError
    from agent.kube.errors import ClusterConfigError

    try:
        service = DraService(node.dra_config(), cluster.get(), node.hardware.topology, node.paths.state_dir, registry,
                             verdicts=verdicts, mig_minors=node.hardware.mig_minors)
    except (SocketPathError, ClusterConfigError) as exc:
        raise StartupError(f"dra: {exc}") from exc

    async def on_topology(topology: Topology) -> None:
        service.update_topology(topology)

    return service, Subsystem("dra", service.run, on_topology)


def _gpu_bus_id(hardware: Hardware, device_id: str) -> str | None:
    """The bus id of the GPU a GPU or MIG UUID names (a MIG device's parent); pod_events asks only for those."""
    gpu = hardware.topology.gpu_of(device_id)
    return gpu.bus_id if gpu is not None else None


def ownership(cfg: AgentConfig, registry: CollectorRegistry, cluster: ClusterPort,
              kubelet: LocalKubelet | None, hardware: Hardware | None = None) -> OwnershipSubsystem:
    """Who holds which device: the kubelet's PodResources API (the stand-in kubelet's records when the agent
    brought one), pod specs from the own-node pod watch and pod Events when the API server is reachable (naming
    the GPU's bus id from `hardware`'s current topology)."""
    from agent.host.podresources import PodResourcesPort, Reachability
    from agent.host.podresources.simulated import InMemoryPodResources
    from agent.kube.errors import ClusterConfigError
    from agent.ownership.subsystem import OwnershipSubsystem, open_port

    pc = cfg.pod_resources
    port: PodResourcesPort
    if kubelet is not None:
        port = InMemoryPodResources(kubelet.records, Reachability(registry, "the stand-in kubelet"))
    else:
        port = open_port(pc.socket, registry)
    try:
        api: Cluster | None = cluster.get()
    except ClusterConfigError as exc:
        log.info("device ownership without pod specs or pod Events: %s", exc)
        api = None
    gpu_of = None if hardware is None else lambda device_id: _gpu_bus_id(hardware, device_id)
    return OwnershipSubsystem(port, registry, cluster=api, poll_interval=pc.poll_interval_seconds,
                              lookup_timeout=pc.lookup_timeout_seconds, gpu_of=gpu_of)


def _preflight_probes(hardware: Hardware) -> list[PreflightCheck]:
    """Active health probes for preflight, on the same NVML and link sources health watches."""
    from agent.remediation.preflight import probe_check

    return [probe_check(name, probe) for name, probe in hardware.preflight_probes().items()]


def remediation(cfg: AgentConfig, hardware: Hardware, registry: CollectorRegistry, *,
                verdicts: Latest[NodeVerdict], cluster: ClusterPort, pods_of: PodsOf | None = None,
                reset_listener: GpuResetListener | None = None) -> RemediationService:
    """Act on this node's API objects (`cluster`: a real API server, or the in-memory node when no credentials
    are given); `--dry-run` only logs and records Events. `pods_of` (ownership) names the pods holding the
    affected devices; `reset_listener` (health) is told about each GPU reset."""
    from agent.kube.errors import ClusterConfigError
    from agent.remediation import build_service
    from agent.remediation.preflight import build_checks

    rc = cfg.remediation
    checks = build_checks(expected_gpus=rc.preflight_gpu_count, gpu_count=lambda: len(hardware.topology.gpus),
                          command=rc.preflight_command, command_timeout=rc.preflight_command_timeout_seconds,
                          extra=_preflight_probes(hardware))
    resetter = None
    if rc.gpu_resets:
        from agent.host.gpu_reset import GpuResetter

        resetter = GpuResetter(hardware.nvml, rc.gpu_reset_command, rc.gpu_reset_timeout_seconds)
    try:
        return build_service(rc, cluster.node_name, verdicts, registry, cluster=cluster.get(),
                             preflight_checks=checks, resetter=resetter, pods_of=pods_of,
                             reset_listener=reset_listener)
    except (ValueError, ClusterConfigError) as exc:
        raise StartupError(f"remediation: {exc}") from exc


@dataclass
class Wiring:
    """Every enabled subsystem, and the shared client the process closes after they stop."""

    cluster: ClusterPort
    subsystems: list[Subsystem] = field(default_factory=list)
    device_plugin: DevicePluginManager | None = None
    ownership: OwnershipSubsystem | None = None
    dra: DraService | None = None
    remediation: RemediationService | None = None
    netacct: NetacctService | None = None
    shaping: ShapingService | None = None

    def describe(self) -> str:
        """Which cluster and which mode, for the start line."""
        if self.remediation is None:
            mode = "off"
        else:
            mode = "dry-run (decisions logged and sent as Events only)" if self.remediation.config.dry_run \
                else "acting on the node"
        return f"cluster: {self.cluster.describe()}; remediation: {mode}"


def build(node: Node, registry: CollectorRegistry, *, readiness: Readiness, rescan: asyncio.Event,
          cluster: ClusterPort | None = None) -> Wiring:
    """Every enabled subsystem of the opened node, in the order data flows, each given its collaborators when it
    is built: the stand-in kubelet -> ownership -> device plugin -> DRA -> health -> remediation -> netacct ->
    shaping -> rescans. Raises `StartupError` for a config that cannot run."""
    cfg, hardware = node.serving, node.hardware
    port = cluster or ClusterPort(cfg, registry)
    subsystems: list[Subsystem] = []
    verdicts: Latest[NodeVerdict] = Latest()  # the node verdict, health -> remediation
    device_health = DeviceHealth()  # Unhealthy devices: health writes, the device plugin reads
    kubelet = stand_in_kubelet(node)
    owners = None
    if cfg.pod_resources.socket:
        owners = ownership(cfg, registry, port, kubelet, hardware)
        subsystems.append(Subsystem("ownership", owners.run))
    manager = None
    if cfg.device_plugin.enabled:
        manager, served = device_plugin(node, registry, readiness=readiness, device_health=device_health,
                                        kubelet=kubelet, ownership=owners.service if owners is not None else None)
        subsystems.append(served)
    driver = None
    if cfg.dra.enabled:
        driver, drives = dra(node, registry, cluster=port, verdicts=verdicts)
        subsystems.append(drives)
    watched, health_service = health(node, registry, readiness=readiness, manager=manager,
                                     device_health=device_health, verdicts=verdicts, dra=driver,
                                     device_health_copies=[owners.health_changes] if owners is not None else [])
    subsystems.append(watched)
    remediates = None
    if cfg.remediation.enabled or port.in_memory:  # the in-memory node: remediation is part of the demo
        # the node condition names the pods holding the affected devices; health hears of each GPU reset
        remediates = remediation(cfg, hardware, registry, verdicts=verdicts, cluster=port,
                                 pods_of=owners.service.pods_holding_now if owners is not None else None,
                                 reset_listener=health_service)
        subsystems.append(Subsystem("remediation", remediates.run))
    if cfg.node_labels.mode != "off":
        labels = node_labels(node, registry, cluster=port, device_health=device_health,
                             health_ready=health_service.first_pass_done)
        if labels is not None:
            subsystems.append(labels)
    accounts = None
    if cfg.netacct.enabled:
        accounts = netacct(cfg, registry, port)
        subsystems.append(run_keeping_kernel_state("netacct", accounts))
    shapes = None
    if cfg.shaping.enabled:
        shapes = shaping(cfg, registry, port, accounts)
        subsystems.append(run_keeping_kernel_state("shaping", shapes))
    listeners = [s.on_topology for s in subsystems if s.on_topology is not None]
    subsystems.append(rescans(hardware, rescan, cfg.topology.rescan_interval_seconds, listeners, registry))
    return Wiring(port, subsystems, device_plugin=manager, ownership=owners, dra=driver, remediation=remediates,
                  netacct=accounts, shaping=shapes)
