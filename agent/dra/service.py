"""The DRA driver as one subsystem: the pool from the topology and device health, published and prepared.

Inputs: the topology (rescans replace it), device health (`set_device_health`, keyed like the device plugin's
health events: GPU or MIG UUID, or function bus id; a GPU's fault covers its MIG devices) and the node verdict:
the devices a `drain` verdict names (GPU UUIDs, NIC bus ids; a PF's bus id covers its VFs, a GPU's its MIG
devices) are tainted `NoExecute`, which evicts their pods, instead of `NoSchedule`. Outputs: this node's
ResourceSlices, the kubelet plugin sockets, CDI specs per claim. A publish happens at start, on every change of
the pool, after each registration with the kubelet (which wipes the node's slices when it starts) and every
`resync_seconds`; API failures are retried with backoff and never stop the sockets, so pods already placed can
still be prepared and unprepared.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent import aio
from agent.config.model import DraConfig
from agent.deviceplugin.nvidia import MIG_MINORS
from agent.dra.cdi import CdiSpecs
from agent.dra.devices import AttributeLimitError, DraDevice, node_devices
from agent.dra.grpc_api import DraV1, DraV1beta1, HealthBook, ResourceHealth
from agent.dra.pool import DeviceFault, device_entries
from agent.dra.prepare import ClaimPreparer
from agent.dra.slices import SlicePublisher
from agent.dra.sockets import PluginSockets
from agent.dra.state import PreparedStore
from agent.kube.errors import ApiError
from agent.kube.port import ResourceClaimApi, ResourceSliceApi
from agent.signals import Latest, NodeVerdict, Severity
from agent.supervisor import Backoff
from agent.topology.model import Topology

log = logging.getLogger(__name__)

BACKOFF_INITIAL = 1.0
BACKOFF_MAX = 60.0
SOCKET_CHECK_SECONDS = 1.0  # how soon a deleted socket is served again


class DraApi(ResourceSliceApi, ResourceClaimApi, Protocol):
    """What the driver does on the API server."""


class DraService:
    """ResourceSlice publisher + kubelet DRA plugin for one node."""

    def __init__(self, cfg: DraConfig, api: DraApi, topology: Topology, state_dir: Path | str,
                 registry: CollectorRegistry | None = None, *,
                 verdicts: Latest[NodeVerdict] | None = None, dev_root: str = "/",
                 mig_minors: str = MIG_MINORS) -> None:
        self.cfg = cfg
        self.node = api.node_name
        self.devices: dict[str, DraDevice] = {}
        self.faults: dict[str, DeviceFault] = {}
        self.drain_ids: frozenset[str] = frozenset()  # what a drain verdict names
        self._verdicts = verdicts
        self._changed = asyncio.Event()
        self.registered = asyncio.Event()
        self.publishes = Counter("gpu_node_agent_dra_slice_publishes", "ResourceSlice reconciliations by result "
                                 "(changed, unchanged, error)", ["result"], registry=registry)
        self.claims = Counter("gpu_node_agent_dra_claims", "NodePrepareResources/NodeUnprepareResources claims by "
                              "call and result (ok, error)", ["call", "result"], registry=registry)
        self.update_topology(topology)
        self.publisher = SlicePublisher(api, cfg.driver_name)
        self.preparer = ClaimPreparer(api, driver=cfg.driver_name, pool=self.node, store=PreparedStore(state_dir),
                                      cdi=CdiSpecs(cfg.cdi_spec_dir, cfg.driver_name, cfg.rdma_resource_name,
                                                   dev_root=dev_root, mig_minors=mig_minors),
                                      devices=lambda: self.devices,
                                      observe=lambda call, ok: self.claims.labels(call, "ok" if ok else "error").inc())
        unreadable = Gauge("gpu_node_agent_dra_state_unreadable", "1 while the prepared-claims record cannot be read: "
                           "devices in unknown use, every prepare refused", registry=registry)
        unreadable.set_function(lambda: 1.0 if self.preparer.store.problem is not None else 0.0)
        self.health = HealthBook()
        self.sockets = PluginSockets(driver=cfg.driver_name, plugin_dir=cfg.socket_dir,
                                     registry_dir=cfg.plugin_registry_dir, dra_v1=DraV1(self.preparer),
                                     dra_v1beta1=DraV1beta1(self.preparer), health=ResourceHealth(self.health),
                                     on_status=self._on_registration)

    def update_topology(self, topology: Topology) -> None:
        """A rescan: rebuild the pool (published on the next turn of `run`)."""
        try:
            devices = node_devices(topology, self.cfg.rdma_resource_name, gpus=self.cfg.gpus, rdma=self.cfg.rdma)
        except AttributeLimitError as exc:  # keep the last good pool rather than publish what the API refuses
            log.error("DRA: the rescanned devices cannot be published: %s", exc)
            return
        self.devices = {d.name: d for d in devices}
        self._changed.set()

    def set_device_health(self, device_id: str, healthy: bool, reason: str = "", *, drain: bool = False) -> None:
        """Health of one device (GPU UUID or bus id): Unhealthy adds a taint, recovery removes it."""
        fault = None if healthy else DeviceFault(reason or "Unhealthy", drain)
        if self.faults.get(device_id) == fault:
            return
        if fault is None:
            self.faults.pop(device_id, None)
        else:
            self.faults[device_id] = fault
        self._changed.set()

    def set_node_verdict(self, verdict: NodeVerdict) -> None:
        """The devices of a drain verdict get NoExecute taints while they are Unhealthy."""
        drain = frozenset(verdict.devices) if verdict.severity >= Severity.DRAIN else frozenset()
        if drain != self.drain_ids:
            self.drain_ids = drain
            self._changed.set()

    def fault_of(self, device: DraDevice) -> DeviceFault | None:
        """The device's own fault, else (a MIG device) its parent GPU's: an Unhealthy GPU takes its MIG devices."""
        return next((fault for i in device.health_ids if (fault := self.faults.get(i)) is not None), None)

    def effective_faults(self) -> dict[str, DeviceFault]:
        """Each Unhealthy device's fault by `health_id`, as a drain when the device, its parent GPU or its PF is
        named by a drain verdict."""
        out: dict[str, DeviceFault] = {}
        for device in self.devices.values():
            fault = self.fault_of(device)
            if fault is None:
                continue
            named = not self.drain_ids.isdisjoint(device.health_ids) or (
                device.pf is not None and device.pf.bus_id in self.drain_ids)
            out[device.health_id] = DeviceFault(fault.reason, fault.drain or named)
        return out

    async def _follow_verdicts(self, verdicts: Latest[NodeVerdict]) -> None:
        seen = 0
        while True:
            seen, verdict = await verdicts.wait_newer(seen)
            self.set_node_verdict(verdict)

    def _on_registration(self, registered: bool, error: str) -> None:
        if registered:
            log.info("DRA: the kubelet registered driver %s", self.cfg.driver_name)
            self.registered.set()
            self._changed.set()  # a starting kubelet wiped the node's slices
        else:
            log.error("DRA: the kubelet refused driver %s: %s", self.cfg.driver_name, error or "no reason given")
            self.registered.clear()

    async def publish(self) -> bool:
        """One reconciliation of the slices and the health stream; True when the slices changed."""
        ordered = list(self.devices.values())
        faults = self.effective_faults()
        await self.health.set({(self.node, d.name): (d.health_id not in faults,
                                                     faults[d.health_id].reason if d.health_id in faults else "")
                               for d in ordered})
        result = await self.publisher.publish(device_entries(ordered, faults))
        self.publishes.labels("changed" if result.changed else "unchanged").inc()
        return result.changed

    async def run(self, stop: asyncio.Event) -> None:
        """Serve and publish until `stop`."""
        loop = asyncio.get_running_loop()
        backoff = Backoff(BACKOFF_INITIAL, BACKOFF_MAX)
        self._changed.set()
        next_resync = loop.time()
        follower = asyncio.create_task(self._follow_verdicts(self._verdicts)) if self._verdicts is not None else None
        try:
            while not stop.is_set():
                if await self.sockets.ensure():
                    self.registered.clear()
                if self._changed.is_set() or loop.time() >= next_resync:
                    self._changed.clear()
                    try:
                        await self.publish()
                        backoff.reset()
                        next_resync = loop.time() + self.cfg.resync_seconds
                    except ApiError as exc:
                        self.publishes.labels("error").inc()
                        delay = backoff.next()
                        log.warning("DRA: publishing ResourceSlices failed (%s); retrying in %.0f s", exc, delay)
                        self._changed.set()
                        await aio.sleep_or_stop(stop, delay)
                        continue
                wait = max(0.0, min(SOCKET_CHECK_SECONDS, next_resync - loop.time()))
                await aio.wait_any(stop, self._changed, timeout=wait)
        finally:
            await aio.cancel_and_wait(follower)
            await self.sockets.stop()
