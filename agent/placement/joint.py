"""The PCIe-aware preference policy as the servers use it: one `JointAllocator` per manager, shared by all of
its resources, so that a GPU call and a NIC call of one container can see each other.

Each GetPreferredAllocation takes the other kind's devices just allocated to this container from the shared
`AdmissionContext` (see its docstring for why that is the same container, and when it is not), then asks the
pure policy (`allocation.preferred_allocation`) with them and with an estimate of the other kind's free
devices. Each successful Allocate is recorded there, and counted in `gpu_node_agent_allocations_total` by the
level the container achieved (`metrics`). Everything is in memory, O(devices) per call, no I/O, no await.

The other kind's free devices (`other_free`): the healthy devices of the other kind's pools, less the ones
believed taken. Believed taken, per resource: those the kubelet left out of its last GetPreferredAllocation
offer for that resource (its `available` is healthy minus allocated, so these are allocated, or Unhealthy in
the kubelet's view) plus its `must_include`, plus every device allocated here since, less the devices of
containers seen to have ended. The kubelet never tells a plugin when a pod ends, but it frees all of a pod's
devices at once: when a device allocated here shows up in an offer again, its container has ended, so the
devices it was paired with (other resource) are free too. Limits:
- devices of an ended container count as taken until one of them is offered again; so does a lone device of
  a NIC-only or GPU-only container until its own resource's next preference call (the policy may then spare
  a switch that has free partners; it never picks a taken device: `available` is the kubelet's own list);
- the pairing is the admission context's guess (same container); where it is wrong, the release of one
  container frees the other's devices in the estimate too early;
- a device that was Unhealthy in the kubelet's view at the last offer and has recovered since looks taken
  until that resource's next preference call (one added by a rescan since is believed free);
- before the first preference call of a resource, only what was allocated since the agent started is taken
  (the kubelet's checkpoint of older allocations is unknown), and a restart of the agent forgets pairings;
- the kubelet re-runs Allocate for a container that has no recorded devices at start (node-reboot race):
  that is recorded as a fresh allocation.
The exact answer is in the kubelet's PodResources API (`List`); using it would mean I/O on the hot path (or a
background poll), so it is a later improvement. When the other kind is not served here at all (GPUs served by
NVIDIA's plugin: NIC-only), `other_free` is None and the policy assumes every GPU free, which spreads VFs over
PFs. Several NIC pools (say RDMA VFs and an Ethernet pool) all count as the NIC kind, and share the one
admission-context slot for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.placement.admission import DEFAULT_TTL_S, AdmissionContext
from agent.placement.policy import AllocationRequest, DeviceKind, achieved_levels, preferred_allocation
from agent.deviceplugin.metrics import NO_PAIR, AllocationMetrics, level_label
from agent.deviceplugin.pools import ResourcePool
from agent.deviceplugin.server import simple_policy
from agent.topology.model import Topology

log = logging.getLogger(__name__)


class ServedResource(Protocol):
    """What the allocator reads of each server: its pool and which devices are healthy now."""

    @property
    def pool(self) -> ResourcePool:
        """The pool currently served."""

    def healthy_ids(self) -> frozenset[str]:
        """IDs of the pool's devices not marked Unhealthy."""


@dataclass(eq=False)
class _Container:
    """One container's devices allocated here, per resource, as far as the agent can tell."""

    kind: DeviceKind  # of its first allocation
    resource: str
    first: frozenset[str]
    at: float
    held: dict[str, set[str]] = field(default_factory=dict)  # resource -> device IDs not yet seen freed


def other_kind(kind: DeviceKind) -> DeviceKind:
    """GPU for NIC and NIC for GPU."""
    return DeviceKind.NIC if kind is DeviceKind.GPU else DeviceKind.GPU


class JointAllocator:
    """Preference policy plus Allocate hook shared by all servers of one manager.

    `prefer` is a `server.PreferencePolicy` and `allocated` a `server.AllocationHook`. Call both from the event
    loop that runs the servers (the gRPC handlers do): the state is not locked, and no call awaits.
    `peers` returns the servers of the manager as they are now (pools change on rescans).
    """

    def __init__(self, peers: Callable[[], Iterable[ServedResource]], *,
                 metrics: AllocationMetrics | None = None, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._peers = peers
        self._metrics = metrics
        self._ttl_s = ttl_s
        self._clock = clock
        self.admission = AdmissionContext(ttl_s=ttl_s, clock=clock)
        self._taken: dict[str, frozenset[str]] = {}  # resource -> devices believed allocated
        self._holder: dict[str, _Container] = {}  # device ID -> the container believed to hold it
        self._open: _Container | None = None  # its other resource may still come

    def prefer(self, pool: ResourcePool, available: Sequence[str], must_include: Sequence[str],
               size: int) -> list[str]:
        """The PCIe-aware preference for one container request of `pool`'s resource ([] = no preference)."""
        kind = DeviceKind(pool.kind)
        context = self.admission.begin_preference(kind, available, must_include)
        self._offered(pool, available, must_include)
        self._preference_started(kind, context)
        if pool.topology is None:  # a pool built by hand, not from a scan: nothing to align with
            return simple_policy(pool, available, must_include, size)
        return preferred_allocation(AllocationRequest(
            topology=pool.topology, kind=kind, available=frozenset(available), size=size,
            must_include=frozenset(must_include), context=context, other_free=self.other_free(kind)))

    def allocated(self, pool: ResourcePool, device_ids: Sequence[str]) -> None:
        """Allocate of `pool`'s resource succeeded with `device_ids`: record it and count it."""
        kind = DeviceKind(pool.kind)
        resource = pool.resource_name
        ids = frozenset(device_ids)
        self.admission.record_allocation(kind, ids)
        self._taken[resource] = self._taken.get(resource, frozenset()) | ids
        container = self._open
        if container is not None and container.kind != kind and not self._stale(container):
            self._open = None  # the second resource of that container
            label = self._pair_level(pool.topology, kind, ids, container.first)
            self._count(container.resource, label)
            self._count(resource, label)
        else:
            self._close_open()
            container = _Container(kind, resource, ids, self._clock())
            if self.serves(other_kind(kind)):
                self._open = container
            else:
                self._count(resource, NO_PAIR)
        for device_id in ids:
            previous = self._holder.get(device_id)
            if previous is not None and previous is not container:  # reallocated without an offer between
                for held in previous.held.values():
                    held.discard(device_id)
            self._holder[device_id] = container
        container.held.setdefault(resource, set()).update(ids)

    def other_free(self, kind: DeviceKind) -> frozenset[str] | None:
        """Healthy devices of the other kind believed free; None when no pool of the other kind is served."""
        wanted = other_kind(kind).value
        free: set[str] = set()
        served = False
        for peer in self._peers():
            if peer.pool.kind == wanted:
                served = True
                free |= peer.healthy_ids() - self._taken.get(peer.pool.resource_name, frozenset())
        return frozenset(free) if served else None

    def serves(self, kind: DeviceKind) -> bool:
        """Whether any server of `kind` runs in this manager."""
        return any(peer.pool.kind == kind.value for peer in self._peers())

    def _offered(self, pool: ResourcePool, available: Sequence[str], must_include: Sequence[str]) -> None:
        """The kubelet's offer: what it left out is taken; a device of ours in it ended its container."""
        must = frozenset(must_include)
        for device_id in available:
            container = self._holder.get(device_id)
            if container is not None and device_id not in must:
                self._release(container)
        self._taken[pool.resource_name] = (frozenset(pool.ids) - frozenset(available)) | must

    def _release(self, container: _Container) -> None:
        for resource, held in container.held.items():
            self._taken[resource] = self._taken.get(resource, frozenset()) - held
            for device_id in held:
                if self._holder.get(device_id) is container:
                    del self._holder[device_id]
        container.held.clear()

    # Pairing, for the metric and the release of a container's devices. It follows the admission context's
    # rules: an Allocate completes a pair when the previous Allocate was of the other kind, within `ttl_s`,
    # and no preference call of that same other kind, nor one that found no context, came in between. A lone
    # allocation is counted (level `none`) when the next call shows it had no partner, or at once when the
    # other kind is not served here.

    def _preference_started(self, kind: DeviceKind, context: frozenset[str]) -> None:
        container = self._open
        if container is not None and (container.kind == kind or not context or self._stale(container)):
            self._close_open()

    def _close_open(self) -> None:
        container, self._open = self._open, None
        if container is not None:
            self._count(container.resource, NO_PAIR)

    def _count(self, resource: str, label: str) -> None:
        if self._metrics is not None:
            self._metrics.allocated(resource, label)

    @staticmethod
    def _pair_level(topology: Topology | None, kind: DeviceKind, ids: frozenset[str],
                    partner: frozenset[str]) -> str:
        if topology is None:
            return NO_PAIR
        gpus, nics = (ids, partner) if kind is DeviceKind.GPU else (partner, ids)
        try:
            return level_label(achieved_levels(topology, gpus, nics))
        except Exception:  # metrics must never fail an Allocate
            log.exception("cannot compute the GPU-NIC level of an allocation")
            return NO_PAIR

    def _stale(self, container: _Container) -> bool:
        return self._clock() - container.at > self._ttl_s
