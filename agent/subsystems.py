"""How each subsystem is built from the config and handed to the supervisor.

This is the one place that knows every subsystem; each gets the shared pieces (hardware, metrics registry,
readiness) and nothing else, and data flows one way: hardware -> topology -> consumers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from agent import aio
from agent.app import Supervisor
from agent.config import AgentConfig
from agent.host.hardware import Hardware
from agent.http import Readiness
from agent.topology.model import Topology

if TYPE_CHECKING:
    from agent.deviceplugin.manager import DevicePluginManager
    from agent.kube.port import Cluster
    from agent.netacct.service import NetacctService
    from agent.remediation import RemediationService
    from agent.shaping.service import ShapingService
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
    # node verdicts from health to remediation (only the latest one matters to remediation)
    verdicts: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    stop: asyncio.Event | None = None
    exit_code: int = 0
    # the one Kubernetes API client of the process, shared by remediation and netacct (see `kube_cluster`)
    cluster: Cluster | None = None

    def fatal(self, code: int, reason: str) -> None:
        """End the process with `code`: a condition the operator asked to treat as fatal (e.g. no NVML)."""
        log.critical("%s; stopping the agent", reason)
        self.exit_code = code
        if self.stop is not None:
            self.stop.set()

    @property
    def simulate(self) -> bool:
        """True when running on a simulated node."""
        return self.cfg.topology.simulate is not None

    def kube_cluster(self) -> Cluster:
        """The process's one cluster port (`agent.kube.open_cluster`), made on first use; `aclose()` releases it.
        `ClusterConfigError` without a node name or credentials."""
        if self.cluster is None:
            from agent.kube import open_cluster

            api = self.cfg.api_server
            self.cluster = open_cluster(self.cfg.node_name, self.registry, simulate=self.simulate,
                                        kubeconfig=api.kubeconfig, timeout=api.timeout_seconds)
        return self.cluster

    async def aclose(self) -> None:
        """Release what subsystems share (after every subsystem has stopped)."""
        cluster, self.cluster = self.cluster, None
        if cluster is not None:
            await cluster.aclose()


async def run_rescans(ctx: Context, stop: asyncio.Event) -> None:
    """Rescan hardware on SIGHUP and on a slow timer; publish a changed topology to the listeners."""
    while not stop.is_set():
        await aio.wait_any(stop, ctx.rescan, timeout=ctx.cfg.topology.rescan_interval_seconds)
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


async def _show_sample_allocations(kubelet: LocalKubelet, manager: DevicePluginManager,
                                   topology: Topology) -> None:
    """Simulate mode: admit a few containers through the stand-in kubelet and log what they got, and how close."""
    from agent.deviceplugin.allocation import achieved_levels

    resources = sorted(manager.resources)
    gpu_resources = [r for r in resources if manager.plugin(r).pool.kind == "gpu"]
    for size in (1, 2, 4):
        request = dict.fromkeys(resources, size)
        try:
            allocation = await kubelet.admit(request)
        except Exception as exc:  # a demo must never take the agent down
            log.warning("sample allocation of %s failed: %s", request, exc)
            return
        gpus = [i for r in gpu_resources for i in allocation.get(r, [])]
        nics = [i for r in resources if r not in gpu_resources for i in allocation.get(r, [])]
        hcas = [getattr(topology.find(i), "rdma", None) or i for i in nics]
        if gpus:
            indexes = [g.index for g in topology.gpus if g.uuid in gpus]
            levels = [level.name for level in achieved_levels(topology, gpus, nics)]
            log.info("sample allocation: %d GPU + %d NIC container got GPUs %s and HCAs %s; GPU-NIC levels %s",
                     size, size, indexes, hcas, levels)
        else:
            log.info("sample allocation: %d-NIC container (GPUs served elsewhere) got HCAs %s on PFs %s", size,
                     hcas, sorted({getattr(topology.find(i), "pf_bus_id", i) for i in nics}))
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
    manager = DevicePluginManager(cfg, ctx.hardware.topology, registry=ctx.registry)
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
        samples: asyncio.Task[None] | None = None
        try:
            await manager.start()
            while not stop.is_set():
                registered = manager.registered.is_set()
                ctx.readiness.set("device-plugin registered", registered)
                if registered and kubelet is not None and samples is None:
                    samples = asyncio.create_task(_show_sample_allocations(kubelet, manager, ctx.hardware.topology))
                await aio.sleep_or_stop(stop, 0.5)
        finally:
            ctx.readiness.set("device-plugin registered", False)
            if samples is not None:  # a demo must never hold up shutdown
                samples.cancel()
                await asyncio.gather(samples, return_exceptions=True)
            await manager.stop()
            if kubelet is not None:
                await kubelet.stop()

    supervisor.add("device-plugin", run)


def install_health(supervisor: Supervisor, ctx: Context) -> None:
    """GPU and NIC health: device health to the device plugin, node verdicts to remediation."""
    from agent.config.model import AgentConfig as _Defaults
    from agent.health.service import HealthService, NvmlRequiredError

    cfg = ctx.cfg.health
    state_dir = Path(ctx.cfg.state_dir)
    if ctx.simulate:
        if cfg.kmsg == "/dev/kmsg":  # simulated GPUs must not be judged by the host's kernel log
            cfg = dataclasses.replace(cfg, kmsg="")
        if ctx.cfg.state_dir == _Defaults().state_dir:  # a newcomer's laptop: no root-owned state dir
            state_dir = ctx.scratch / "state"
    manager = ctx.device_plugin
    events = manager.health_events if manager is not None else asyncio.Queue()
    link_port = ctx.hardware.links

    def resource_of(device_id: str) -> str | None:
        if manager is None:
            return None
        return next((name for name in manager.resources if device_id in manager.plugin(name).pool.ids), None)

    health = HealthService(cfg, state_dir, ctx.hardware.topology, ctx.hardware.nvml, events, ctx.registry,
                           link_port, resource_of=resource_of)
    ctx.readiness.require("first health pass")

    async def on_topology(topology: Topology) -> None:
        health.update_topology(topology)

    ctx.topology_listeners.append(on_topology)

    async def feed_remediation() -> None:
        # No verdict before the first full pass: an early "healthy" could uncordon a node with a real fault.
        await health.first_pass_done.wait()
        ctx.readiness.set("first health pass")
        ctx.verdicts.put_nowait(health.verdict.published())
        health.add_listener(lambda verdict: ctx.verdicts.put_nowait(verdict.published()))

    async def run(stop: asyncio.Event) -> None:
        feeder = asyncio.create_task(feed_remediation())
        drain = None if manager is not None else asyncio.create_task(_discard(events))
        try:
            await health.run(stop)
        except NvmlRequiredError as exc:
            ctx.fatal(1, f"health: {exc}")
        finally:
            for task in (feeder, drain):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    supervisor.add("health", run)


async def _discard(queue: asyncio.Queue[Any]) -> None:
    """Device-health events nobody serves (device plugin off) are dropped, not queued forever."""
    while True:
        await queue.get()


def _preflight_probes(ctx: Context) -> list[Any]:
    """Active health probes for preflight, on the same NVML and link sources health watches."""
    from agent.remediation.preflight import probe_check

    return [probe_check(name, probe) for name, probe in ctx.hardware.preflight_probes().items()]


def install_remediation(supervisor: Supervisor, ctx: Context) -> RemediationService:
    """Act on this node's API objects; with --simulate, on an in-memory node and in dry-run."""
    from agent.config import ConfigError
    from agent.kube.errors import ClusterConfigError
    from agent.remediation import build_service
    from agent.remediation.preflight import build_checks

    cfg = ctx.cfg.remediation
    simulate = ctx.simulate
    if simulate and not cfg.dry_run:
        log.info("simulate mode: remediation runs in dry-run against an in-memory node")
        cfg = dataclasses.replace(cfg, dry_run=True)
    checks = build_checks(expected_gpus=cfg.preflight_gpu_count,
                          gpu_count=lambda: len(ctx.hardware.topology.gpus),
                          command=cfg.preflight_command, command_timeout=cfg.preflight_command_timeout_seconds,
                          extra=_preflight_probes(ctx))
    node_name = ctx.cfg.node_name or ("simulated-node" if simulate else "")
    try:
        service = build_service(cfg, node_name, ctx.verdicts, ctx.registry, simulate=simulate,
                                cluster=ctx.kube_cluster(), preflight_checks=checks)
    except (ValueError, ClusterConfigError) as exc:
        raise ConfigError(f"remediation: {exc}") from exc

    supervisor.add("remediation", service.run)  # the shared cluster client is closed by `Context.aclose`
    return service


def install_netacct(supervisor: Supervisor, ctx: Context) -> NetacctService:
    """Network accounting with iptables mangle rules and ipset counters (only with --netacct)."""
    from agent.netacct.service import NetacctService, default_pod_source

    # the pods file if set; else this node's pods from the API (the simulated cluster's with --simulate)
    service = NetacctService(ctx.cfg.netacct, ctx.registry, default_pod_source(ctx.cfg.netacct, ctx.kube_cluster))

    async def run(stop: asyncio.Event) -> None:
        try:
            await service.run(stop)
        finally:
            service.close()  # keeps the rules, so counters continue after a restart; `netacct cleanup` removes them

    supervisor.add("netacct", run)
    return service


def install_shaping(supervisor: Supervisor, ctx: Context, netacct: NetacctService | None) -> ShapingService:
    """Per-pod internet shaping (only with --shaping): netacct's pod source when it runs, else its own."""
    from agent.host.tc_netlink import NetlinkTc
    from agent.kube.errors import ClusterConfigError
    from agent.netacct.service import default_pod_source
    from agent.shaping.service import ShapingService

    pods = netacct.pods if netacct is not None else default_pod_source(ctx.cfg.netacct, ctx.kube_cluster)
    try:
        events = None if ctx.cfg.netacct.pods_file else ctx.kube_cluster()
    except ClusterConfigError:
        events = None  # no cluster: bad annotations are only logged
    service = ShapingService(ctx.cfg.shaping, ctx.cfg.netacct.internal_networks(), ctx.registry, pods, NetlinkTc(),
                             events=events, owns_source=netacct is None)

    async def run(stop: asyncio.Event) -> None:
        try:
            await service.run(stop)
        finally:
            service.close()  # keeps the shapers; `shaping cleanup` (or `netacct cleanup`) removes them

    supervisor.add("shaping", run)
    return service


def install(supervisor: Supervisor, ctx: Context) -> Context:
    """Add every enabled subsystem to the supervisor."""
    cfg = ctx.cfg
    if cfg.device_plugin.enabled:
        install_device_plugin(supervisor, ctx)
    install_health(supervisor, ctx)
    if cfg.remediation.enabled or ctx.simulate:
        install_remediation(supervisor, ctx)
    netacct = install_netacct(supervisor, ctx) if cfg.netacct.enabled else None
    if cfg.shaping.enabled:
        install_shaping(supervisor, ctx, netacct)
    supervisor.add("rescan", lambda stop: run_rescans(ctx, stop))
    return ctx
