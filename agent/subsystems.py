"""`Subsystem`, and the builders of the subsystems that watch the node and its network: health (and the relay of
its device-health flips), node labels, netacct and shaping.

Part of the composition root: `agent.wiring.build` calls these in its order and hands each its collaborators;
nothing else imports this module. Like every builder, each takes exactly what its subsystem needs and returns
values, so tests build one subsystem alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent import aio
from agent.config import AgentConfig
from agent.http import Readiness
from agent.kube.access import ClusterPort
from agent.node import Node
from agent.signals import DeviceHealth, DeviceHealthEvent, Latest, NodeVerdict
from agent.supervisor import RunFn
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.dra.service import DraService
    from agent.health.service import HealthService
    from agent.netacct.service import NetacctService
    from agent.shaping.service import ShapingService

log = logging.getLogger(__name__)

TopologyListener = Callable[[Topology], Awaitable[None]]


@dataclass
class Subsystem:
    """One supervised loop, and what it does with a rescanned topology (if anything)."""

    name: str
    run: RunFn
    on_topology: TopologyListener | None = None


def health(node: Node, registry: CollectorRegistry, *, readiness: Readiness,
           manager: DevicePluginManager | None, device_health: DeviceHealth, verdicts: Latest[NodeVerdict],
           dra: DraService | None = None,
           device_health_copies: Sequence[asyncio.Queue[DeviceHealthEvent]] = ()) -> tuple[Subsystem, HealthService]:
    """GPU and NIC health: device health into its one owner (the device plugin reads it; the DRA driver and each
    of `device_health_copies`, pod Events, are told each flip), the node verdict into `verdicts` for remediation
    once every check has looked once. The service too: remediation tells it about the GPUs it reset."""
    from agent.health.service import HealthService

    hardware = node.hardware
    hc = dataclasses.replace(node.serving.health, kmsg=node.paths.kmsg)
    state_dir = node.paths.state_dir

    def resource_of(device_id: str) -> str | None:
        if manager is None:
            return None
        return next((name for name in manager.resources if manager.plugin(name).pool.serves_physical(device_id)),
                    None)

    nvsentinel = None
    if hc.nvsentinel_socket:  # NVSentinel's platform connector, as one of its monitors (agent.health.nvsentinel)
        import socket

        from agent.host.nvsentinel.client import GrpcConnector

        nvsentinel = GrpcConnector(hc.nvsentinel_socket)
    service = HealthService(hc, state_dir, hardware.topology, hardware.nvml, device_health, registry, hardware.links,
                            verdicts=verdicts, resource_of=resource_of, nic_sysfs=hardware.counters,
                            nvsentinel=nvsentinel,
                            node_name=node.cfg.node_name or (socket.gethostname() if nvsentinel else ""))
    readiness.require("first health pass")

    async def ready_after_first_pass() -> None:
        await service.first_pass_done.wait()  # health publishes its first node verdict at this point too
        readiness.set("first health pass")

    async def run(stop: asyncio.Event) -> None:
        helpers = [asyncio.create_task(ready_after_first_pass())]
        if dra is not None or device_health_copies:
            helpers.append(asyncio.create_task(_relay_flips(device_health, dra, device_health_copies)))
        try:
            await service.run(stop)
        finally:
            await aio.cancel_and_wait(*helpers)

    async def on_topology(topology: Topology) -> None:
        service.update_topology(topology)

    return Subsystem("health", run, on_topology), service


async def _relay_flips(device_health: DeviceHealth, dra: DraService | None,
                       copies: Sequence[asyncio.Queue[DeviceHealthEvent]] = ()) -> None:
    """Each device-health flip to the DRA driver (which taints its devices) and onto each of `copies` (pod
    Events); the device plugin reads the owner itself."""
    seen = 0
    told: set[str] = set()  # told Unhealthy: only to heal the right devices after falling behind the history
    while True:
        version = await device_health.wait_newer(seen)
        flips = device_health.since(seen)
        seen = version
        if flips is None:  # fell behind: the current state instead of the flips
            current = device_health.unhealthy()
            flips = [DeviceHealthEvent(d, True) for d in told - current.keys()] + \
                [DeviceHealthEvent(d, False, r) for d, r in current.items()]
        for event in flips:
            (told.discard if event.healthy else told.add)(event.device_id)
            if dra is not None:
                dra.set_device_health(event.device_id, event.healthy, event.reason)
            for copy in copies:
                copy.put_nowait(event)


def netacct(cfg: AgentConfig, registry: CollectorRegistry, cluster: ClusterPort) -> NetacctService:
    """Network accounting with iptables mangle rules and ipset counters (only with --netacct)."""
    from agent.netacct.service import NetacctService
    from agent.pods.choice import open_pod_source

    # the pods file if set; else this node's pods from the API (the in-memory cluster's without credentials)
    return NetacctService(cfg.netacct, registry, open_pod_source(cfg.netacct.pods_file, cluster.get))


def run_keeping_kernel_state(name: str, service: NetacctService | ShapingService) -> Subsystem:
    """netacct or shaping: `close` keeps what they wrote in the kernel (rules, sets, shapers), so counters and
    limits continue across a restart; `netacct cleanup` / `shaping cleanup` remove them."""
    async def run(stop: asyncio.Event) -> None:
        try:
            await service.run(stop)
        finally:
            service.close()

    return Subsystem(name, run)


def shaping(cfg: AgentConfig, registry: CollectorRegistry, cluster: ClusterPort,
            netacct: NetacctService | None) -> ShapingService:
    """Per-pod internet shaping (only with --shaping): the process's one pod source (`agent.pods`), run by netacct
    when it runs, else by shaping; invalid annotations become Events through the shared client when there is one."""
    from agent.host.tc_netlink import NetlinkTc
    from agent.kube.errors import ClusterConfigError
    from agent.pods.choice import open_pod_source
    from agent.shaping.service import ShapingService

    pods = netacct.pods if netacct is not None else open_pod_source(cfg.netacct.pods_file, cluster.get)
    try:
        events = None if cfg.netacct.pods_file else cluster.get()
    except ClusterConfigError:
        events = None  # no cluster: bad annotations are only logged
    return ShapingService(cfg.shaping, cfg.netacct.internal_networks(), registry, pods, NetlinkTc(),
                          events=events, owns_source=netacct is None)


def node_labels(node: Node, registry: CollectorRegistry, *, cluster: ClusterPort, device_health: DeviceHealth,
                health_ready: asyncio.Event) -> Subsystem | None:
    """Node labels (GFD-compatible keys and the agent's own) on an NFD NodeFeature or the Node; None without a
    cluster to publish on (logged)."""
    from agent.host.nic_sysfs import NicSysfs
    from agent.kube.errors import ClusterConfigError
    from agent.labels import NodeLabels
    from agent.labels.facts import ExpectedGpus, FactReader, GfdPresence, GfdSettings
    from agent.labels.service import NodeLabelService, Settings

    cfg, hardware = node.serving, node.hardware
    lc, rc = cfg.node_labels, cfg.remediation
    try:
        api = cluster.get()
    except ClusterConfigError as exc:
        log.info("node labels off: %s", exc)
        return None
    namespace = rc.pod_namespace or ("default" if cluster.in_memory else "")
    presence = GfdPresence(lc.gfd, api, [namespace, *lc.gfd_namespaces] if namespace else lc.gfd_namespaces,
                           interval=max(300.0, 10 * lc.interval_seconds))
    reader = FactReader(hardware.nvml, lambda: hardware.topology, NicSysfs(hardware.sysfs_root), hardware.sysfs_root,
                        gfd=GfdSettings(cfg.device_plugin.mig_strategy, cfg.device_plugin.time_slicing),
                        presence=presence, expected=ExpectedGpus(lc.expected_gpus, node.paths.state_dir))
    service = NodeLabelService(reader, device_health, registry, settings=Settings(lc.interval_seconds),
                               health_ready=health_ready)
    return Subsystem("node-labels", NodeLabels(lc.mode, api, service, namespace=namespace, pod_name=rc.pod_name).run)


