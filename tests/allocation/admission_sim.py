"""A node admitting containers the way the kubelet does, with the agent's policy and admission context.

Per container and per resource, in the order given: GetPreferredAllocation (the servicer first takes the
admission context and the free estimate for the other kind), then the kubelet keeps the preferred devices
that are free and fills any gap itself, then Allocate (recorded in the admission context). This is the
servicer's part of the protocol, minus gRPC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.deviceplugin.admission import AdmissionContext
from agent.deviceplugin.allocation import AllocationRequest, DeviceKind, achieved_levels, preferred_allocation
from agent.topology.model import Level, Topology
from tests.fakes.nodes import gpu_ids, nic_ids

GPU, NIC = DeviceKind.GPU, DeviceKind.NIC


def other_kind(kind: DeviceKind) -> DeviceKind:
    return NIC if kind is GPU else GPU


@dataclass
class SimulatedAdmission:
    topology: Topology
    serves: frozenset[DeviceKind] = frozenset({GPU, NIC})  # kinds whose preference calls reach the agent
    now: float = 0.0  # the admission context's clock
    admission: AdmissionContext = field(init=False)
    free: dict[DeviceKind, set[str]] = field(default_factory=dict)
    preferences: list[tuple[DeviceKind, list[str]]] = field(default_factory=list)
    # The servicer knows the other kind's free devices exactly (PodResources), rather than estimating them
    # from the last preference call, which misses departures.
    exact_free: bool = False

    def __post_init__(self) -> None:
        self.admission = AdmissionContext(clock=lambda: self.now)
        self.free = {GPU: set(gpu_ids(self.topology)), NIC: set(nic_ids(self.topology))}

    def admit(self, sizes: dict[DeviceKind, int], order: Sequence[DeviceKind]) -> dict[DeviceKind, list[str]]:
        """Allocate one container's resources in `order`; returns the devices it got per kind."""
        got: dict[DeviceKind, list[str]] = {}
        for kind in order:
            size = sizes.get(kind, 0)
            if not size:
                continue
            free = self.free[kind]
            assert len(free) >= size, "the test asked for more than the node has"
            preferred: list[str] = []
            if kind in self.serves:
                available = sorted(free)
                context = self.admission.begin_preference(kind, available)
                other_free = self.admission.free_estimate(other_kind(kind))
                if self.exact_free:
                    other_free = frozenset(self.free[other_kind(kind)])
                preferred = preferred_allocation(AllocationRequest(
                    topology=self.topology, kind=kind, available=frozenset(available), size=size,
                    context=context, other_free=other_free))
                self.preferences.append((kind, preferred))
            chosen = [device for device in preferred if device in free][:size]
            chosen += sorted(free - set(chosen))[: size - len(chosen)]  # the kubelet's own fallback
            free -= set(chosen)
            if kind in self.serves:
                self.admission.record_allocation(kind, chosen)
            got[kind] = chosen
        return got

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def release(self, got: dict[DeviceKind, list[str]]) -> None:
        """The pod went away (the kubelet tells plugins nothing)."""
        for kind, devices in got.items():
            self.free[kind] |= set(devices)

    def levels(self, got: dict[DeviceKind, list[str]]) -> list[Level]:
        return achieved_levels(self.topology, got.get(GPU, ()), got.get(NIC, ()))
