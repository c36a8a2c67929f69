"""The PCIe-aware preference policy as the servers use it: one `JointAllocator` per manager, shared by all of
its resources, so that a GPU call and a NIC call of one container can see each other.

Values in, values out. A preference call (`prefer`) gets the kubelet's request and, as a value, what the
kubelet's records say about the container (`policy.Partner`: its devices of the other kind known, or the
candidates, or unknown and why, and the other kind's free devices); it answers the devices and what it decided
about the container (`policy.Decision`). The servicer keeps that decision and hands it back with the Allocate of
the same resource (`allocated`), which takes it only where it still holds (its resource, no call in between,
within `ttl_s`, devices from its offer); a stale decision is ignored, as if the kubelet had skipped the
preference call. What stays here between calls is allocation history, never a decision: the admission context's
last Allocate (`AdmissionContext`), the container whose other resource may still come, and which devices are
believed taken. Both calls return the level of each container whose pairing became known (`AllocationLevel`),
which the servicer counts in `gpu_node_agent_allocations_total`. In memory, O(devices) per call, no I/O, no
await; the servers know this module through two protocols (`ServedPool`, `ServedResource`).
Why `_open` (the last Allocate's container, unpaired) spans calls: the kubelet calls Allocate once per resource,
so a pair is known only at its second Allocate and a lone container only at the next call. It is history, as the
admission record is: the pair a preference call decides travels in `Decision.pairs_with`, and `_open` alone
decides only for an Allocate with no holding decision. Not a metric only: it groups a pair's devices in one
container, so one of them offered again frees its partners in `other_free`, which the next preference reads.

The container's devices of the other kind: the kubelet's fact when `Partner.held` is known (the other kind's
devices mapped to the topology: a replica `<id>::<n>` is its GPU, a MIG UUID its MIG device; an unknown ID is
logged once and ignored), else the admission context's guess (the devices of the other kind allocated just
before: see its docstring for when that is the same container).

The other kind's free devices (`other_free`): the healthy devices of the other kind's pools, less the ones
believed taken, intersected with the kubelet's free devices (`Partner.free`) when given, so after an agent
restart nothing the kubelet holds looks free, nor does anything allocated since its reading. Believed taken, per
resource: what the kubelet left out of its last offer (its `available` is healthy minus allocated) plus its
`must_include`, plus every device allocated here since, less the devices of containers seen to have ended (a
device allocated here offered again: the kubelet frees a pod's devices at once, so its partners are free too).
Until then an ended container's devices look taken, as do a single-resource container's until its resource's
next preference call, and a device Unhealthy at the last offer that has recovered since; the pairing behind a
release is the same guess, unless a fact gave it. Before a resource's first preference call only what was
allocated since the agent started is taken, and a restart forgets pairings (the kubelet's facts cover both); an
Allocate the kubelet re-runs at its start (node-reboot race) is a fresh allocation. When the other kind is not
served here (NIC-only: GPUs are NVIDIA's plugin's), it is the candidates' devices after an ambiguous lookup, else
the kubelet's free devices, else None: every GPU is assumed free, which spreads VFs over PFs. Several NIC pools
count as the NIC kind. A time-sliced GPU pool is chosen as NVIDIA's plugin chooses replicas (`replicas`), nearest
to the container's NICs first; elsewhere a replica is its GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.placement.admission import DEFAULT_TTL_S, AdmissionContext
from agent.placement.policy import (
    AllocationLevel,
    AllocationRequest,
    ContainerRequest,
    Decision,
    DeviceKind,
    Partner,
    Preference,
    achieved_levels,
    check_request,
    in_served_order,
    preferred_allocation,
)
from agent.placement.replicas import DISTRIBUTED, physical, preferred_replicas
from agent.topology.model import Level, Topology

log = logging.getLogger(__name__)

NO_PAIR = "none"  # the level label of a container with devices of one kind only (as far as the agent saw)
# Not a level: an extra entry beside a pair's levels when it ended worse than PIX although the kubelet's offer at
# its second resource's preference call held a device at PIX to its first (`gpu_node_agent_allocations_pix_missed`)
PIX_MISSED = "pix_missed"


def level_label(levels: Iterable[Level]) -> str:
    """The label of a container's matched GPU-NIC levels: the worst one, `none` when there is none."""
    worst = max(levels, default=None)
    return NO_PAIR if worst is None else worst.name.lower()


class ServedPool(Protocol):
    """What the allocator reads of a resource's device pool (the device plugin's `ResourcePool` is one)."""

    @property
    def resource_name(self) -> str:
        """Full resource name."""

    @property
    def kind(self) -> str:
        """`gpu` or `nic` (a `DeviceKind` value)."""

    @property
    def ids(self) -> tuple[str, ...]:
        """Device IDs in pool order."""

    @property
    def topology(self) -> Topology | None:
        """The node the pool was built from; None for a pool built by hand."""


class ServedResource(Protocol):
    """What the allocator reads of each server: its pool and which devices are healthy now."""

    @property
    def pool(self) -> ServedPool:
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

    Call `prefer` and `allocated` one at a time: the state is not locked here. The servers call them from their
    event loop, and a preference over a big offer from a worker thread, while the servers' shared policy lock
    keeps every other call out (`deviceplugin.server`); no call awaits. `peers` returns the servers of the
    manager as they are now (pools change on rescans).
    """

    def __init__(self, peers: Callable[[], Iterable[ServedResource]], *, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._peers = peers
        self._ttl_s = ttl_s
        self._clock = clock
        self.admission = AdmissionContext(ttl_s=ttl_s, clock=clock)
        self._taken: dict[str, frozenset[str]] = {}  # resource -> devices believed allocated
        self._holder: dict[str, _Container] = {}  # device ID -> the container believed to hold it
        self._open: _Container | None = None  # the last Allocate's container: its other resource may still come
        self._calls = 0  # preference and Allocate calls that touched the state: a decision's stamp
        self._unmapped: set[str] = set()  # partner IDs not in the topology, logged once
        self.replica_policy = DISTRIBUTED  # NVIDIA's sharedDevicesAllocationPolicy for time-sliced replicas

    def prefer(self, pool: ServedPool, request: ContainerRequest) -> Preference:
        """The PCIe-aware preference for one container request of `pool`'s resource, why, and the decision its
        Allocate takes back (`allocated`)."""
        checked = check_request(request)
        if not checked.proceed:
            self._calls += 1  # a call came between: an earlier decision is stale even to a direct caller
            return checked.answered(())
        kind, resource = DeviceKind(pool.kind), pool.resource_name
        must_include = request.must_include
        context = self.admission.begin_preference(kind)
        completes = bool(context)  # it took the record: its Allocate completes that container's pair
        partner: frozenset[str] | None = None
        if request.partner is not None and request.partner.held is not None:  # the kubelet's fact: no guess
            partner = context = self._mapped(pool.topology, kind, request.partner.held)
        elif request.partner is not None:
            log.debug("%s: partner not known (%s)", resource, request.partner.reason or "unknown")
        offer = frozenset(request.available)  # every must_include is in it (`check_request` refuses it otherwise)
        self._offered(resource, request.served, offer, must_include)
        levels = self._preference_started(kind, context)
        opened = self._open  # still unpaired after `_preference_started`: this container may complete its pair
        self._calls += 1
        decision = Decision(resource=resource, offered=offer, partner=partner,
                            completes=completes, stamp=self._calls, at=self._clock(),
                            pix_possible=self._pix_offered(pool.topology, kind, context, checked.offered,
                                                           checked.size),
                            pairs_with=None if opened is None else (opened.resource, opened.first))
        if kind is DeviceKind.GPU and any("::" in device_id for device_id in checked.offered):
            rank = self._nic_rank(pool.topology, context)
            return checked.answered(preferred_replicas(request.served, checked.offered, must_include, checked.size,
                                                       policy=self.replica_policy, rank=rank), levels, decision)
        if pool.topology is None:  # a pool built by hand, not from a scan: nothing to align with
            return checked.answered(in_served_order(request.served, checked.offered, must_include, checked.size),
                                    levels, decision)
        return checked.answered(preferred_allocation(AllocationRequest(
            topology=pool.topology, kind=kind, available=frozenset(checked.offered), size=checked.size,
            must_include=frozenset(must_include), context=context,
            other_free=self.other_free(kind, request.partner))), levels, decision)

    def allocated(self, pool: ServedPool, device_ids: Sequence[str],
                  decision: Decision | None = None) -> list[AllocationLevel]:
        """Allocate of `pool`'s resource succeeded with `device_ids`: record it; the levels now known. `decision`:
        what this resource's last preference call decided (`Preference.decision`), None when there was none."""
        kind = DeviceKind(pool.kind)
        resource = pool.resource_name
        ids = frozenset(device_ids)
        decision = self._holding(decision, resource, ids)
        self._calls += 1
        self.admission.record_allocation(kind, ids, completes=decision is not None and decision.completes)
        self._taken[resource] = self._taken.get(resource, frozenset()) | ids
        levels: list[AllocationLevel] = []
        possible = decision is not None and decision.pix_possible
        partner = decision.partner if decision is not None else None
        container = self._pairing(decision)
        paired = container is not None and container.kind != kind and not self._stale(container)
        if partner:  # a fact: this container holds `partner`
            label = self._pair_level(pool.topology, kind, ids, partner)
            if paired and container is not None and container.first <= partner:
                self._open = None  # its first resource was served here: count it with the pair
                levels.append((container.resource, label))
            else:
                levels += self._close_open()
                container = _Container(kind, resource, ids, self._clock())
            levels.append((resource, label))
        elif paired and partner is None and container is not None:
            self._open = None  # the second resource of that container (the admission context's guess)
            label = self._pair_level(pool.topology, kind, ids, container.first)
            levels += [(container.resource, label), (resource, label)]
        else:
            levels += self._close_open()
            container = _Container(kind, resource, ids, self._clock())
            if self.serves(other_kind(kind)):
                self._open = container
            else:
                levels.append((resource, NO_PAIR))
        for device_id in ids:
            previous = self._holder.get(device_id)
            if previous is not None and previous is not container:  # reallocated without an offer between
                for held in previous.held.values():
                    held.discard(device_id)
            self._holder[device_id] = container
        container.held.setdefault(resource, set()).update(ids)
        if possible:
            levels += [(r, PIX_MISSED) for r, label in levels if label not in (Level.PIX.name.lower(), NO_PAIR)]
        return levels

    def _pairing(self, decision: Decision | None) -> _Container | None:
        """The unpaired container this Allocate may complete: the one its preference call named (a value), or
        with no decision that holds, the last Allocate's (`_open`: the guess an Allocate without a preference
        gets); None when the decision names none."""
        container = self._open
        if decision is None or container is None:
            return container
        # a holding decision is the very last call's, so `_open` is still the container it named, if any
        return container if decision.pairs_with == (container.resource, container.first) else None

    def _holding(self, decision: Decision | None, resource: str, ids: frozenset[str]) -> Decision | None:
        """`decision` when it is this Allocate's: its resource's, the last call before this one, within the
        admission time-out, every device from its offer; None (logged) when it is stale."""
        if decision is None:
            return None
        stale = ("it is another resource's" if decision.resource != resource else
                 "other calls came between" if decision.stamp != self._calls else
                 "it timed out" if self._clock() - decision.at > self._ttl_s else
                 "devices outside its offer were allocated" if not ids <= decision.offered else "")
        if stale:
            log.info("%s: the last preference's decision is not this Allocate's (%s); allocated as without one",
                     resource, stale)
            return None
        return decision

    @staticmethod
    def _nic_rank(topology: Topology | None, nics: frozenset[str]) -> Callable[[str], int] | None:
        """A GPU's level to the nearest of the container's NICs (lower is nearer); None when none are known."""
        if topology is None or not nics:
            return None
        return lambda gpu: int(min(achieved_levels(topology, [gpu], nics), default=Level.SYS + 1))

    @staticmethod
    def _pix_offered(topology: Topology | None, kind: DeviceKind, context: frozenset[str],
                     offered: Sequence[str], size: int) -> bool:
        """Whether `size` of the offered devices could each sit at PIX with one of `context` (the container's
        devices of the other kind, as far as known)."""
        if topology is None or not context or size <= 0:
            return False
        gpus, nics = (offered, context) if kind is DeviceKind.GPU else (context, offered)
        try:
            best = achieved_levels(topology, gpus, nics)[:min(size, len(context))]
        except Exception:  # the metric must never fail a preference
            log.exception("cannot tell whether PIX was possible")
            return False
        return bool(best) and best[-1] is Level.PIX

    def other_free(self, kind: DeviceKind, facts: Partner | None = None) -> frozenset[str] | None:
        """Healthy devices of the other kind believed free, where the kubelet's `facts` agree; None when no pool of
        the other kind is served here and the facts name none."""
        wanted = other_kind(kind)
        free: set[str] = set()
        served = False
        for peer in self._peers():
            if peer.pool.kind == wanted.value:
                served = True
                free |= peer.healthy_ids() - self._taken.get(peer.pool.resource_name, frozenset())
        known = facts.free if facts is not None else None
        if not served:
            if facts is not None and facts.candidates:  # the containers that may be this one hold these
                return frozenset(physical(i) for i in facts.candidates)
            return known
        # free only where both agree: the kubelet's last reading and what was allocated here since
        return frozenset(free) if known is None else frozenset(free) & known

    def _mapped(self, topology: Topology | None, kind: DeviceKind, partner: frozenset[str]) -> frozenset[str]:
        """The partner's device IDs as the topology names them: a shared GPU's replica (`<uuid>::<n>`) is the GPU;
        a MIG UUID is its MIG device (placed at its parent GPU); a GPU named by its PCI bus id (another plugin, or
        a node without NVML) is that GPU; an ID the topology does not know is dropped."""
        if topology is None:
            return partner
        ids = {g.uuid for g in topology.gpus if g.uuid} | {m.uuid for g in topology.gpus for m in g.mig_devices} \
            if kind is DeviceKind.NIC else {v.bus_id for n in topology.nics for v in n.vfs} | \
            {n.bus_id for n in topology.nics}
        mapped = {physical(i) for i in partner}
        if kind is DeviceKind.NIC:
            by_bus_id = {i: topology.gpu_of(i) for i in mapped - ids}
            mapped = {gpu.bus_id if (gpu := by_bus_id.get(i)) is not None else i for i in mapped}
            ids = ids | {gpu.bus_id for gpu in by_bus_id.values() if gpu is not None}
        unknown = mapped - ids - self._unmapped
        if unknown:
            self._unmapped |= unknown
            log.warning("partner devices %s are not on this node's topology; ignored for placement",
                        ", ".join(sorted(unknown)))
        return frozenset(mapped & ids)

    def serves(self, kind: DeviceKind) -> bool:
        """Whether any server of `kind` runs in this manager."""
        return any(peer.pool.kind == kind.value for peer in self._peers())

    def _offered(self, resource: str, served: Sequence[str], offer: frozenset[str],
                 must_include: Sequence[str]) -> None:
        """The kubelet's offer (`available`, must_include among it): what it left out is taken; a device of ours
        in it, not a must_include, ended its container."""
        must = frozenset(must_include)
        for device_id in offer:
            container = self._holder.get(device_id)
            if container is not None and device_id not in must:
                self._release(container)
        self._taken[resource] = (frozenset(served) - offer) | must

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

    def _preference_started(self, kind: DeviceKind, context: frozenset[str]) -> list[AllocationLevel]:
        container = self._open
        if container is not None and (container.kind == kind or not context or self._stale(container)):
            return self._close_open()
        return []

    def _close_open(self) -> list[AllocationLevel]:
        container, self._open = self._open, None
        return [] if container is None else [(container.resource, NO_PAIR)]

    @staticmethod
    def _pair_level(topology: Topology | None, kind: DeviceKind, ids: frozenset[str],
                    partner: frozenset[str]) -> str:
        if topology is None:
            return NO_PAIR
        gpus, nics = (ids, partner) if kind is DeviceKind.GPU else (partner, ids)
        try:
            return level_label(achieved_levels(topology, gpus, nics))
        except Exception:  # the metric must never fail an Allocate
            log.exception("cannot compute the GPU-NIC level of an allocation")
            return NO_PAIR

    def _stale(self, container: _Container) -> bool:
        return self._clock() - container.at > self._ttl_s
