"""A node admitting containers the way the kubelet does, against the `JointAllocator` the agent runs.

Per container and per resource, in the order given: GetPreferredAllocation (the allocator validates the request,
takes the admission context and its estimate of the other kind's free devices), then the kubelet keeps the
preferred devices that are free and fills any gap itself, then Allocate (recorded by the allocator). This is
the servicer's part of the protocol, minus gRPC: the pools and servers are the plain data the allocator's
protocols ask for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agent.placement.joint import JointAllocator
from agent.placement.policy import ContainerRequest, DeviceKind, Partner, achieved_levels
from agent.topology.model import Level, Topology
from tests.fakes.nodes import gpu_ids, nic_ids

GPU, NIC = DeviceKind.GPU, DeviceKind.NIC


def other_kind(kind: DeviceKind) -> DeviceKind:
    return NIC if kind is GPU else GPU


@dataclass(frozen=True)
class Pool:
    """One resource's devices, as `joint.ServedPool` reads them."""

    resource_name: str
    kind: str
    ids: tuple[str, ...]
    topology: Topology | None


@dataclass(frozen=True)
class Server:
    """One resource's server, as `joint.ServedResource` reads it: every device healthy."""

    pool: Pool

    def healthy_ids(self) -> frozenset[str]:
        return frozenset(self.pool.ids)


@dataclass
class SimulatedAdmission:
    topology: Topology
    serves: frozenset[DeviceKind] = frozenset({GPU, NIC})  # kinds whose preference calls reach the agent
    now: float = 0.0  # the allocator's clock
    allocator: JointAllocator = field(init=False)
    pools: dict[DeviceKind, Pool] = field(init=False)
    free: dict[DeviceKind, set[str]] = field(default_factory=dict)
    preferences: list[tuple[DeviceKind, list[str]]] = field(default_factory=list)
    # The servicer knows the other kind's free devices exactly (PodResources, handed in with each request as
    # `Partner.free`), rather than estimating them from what it saw offered and allocated.
    exact_free: bool = False

    def __post_init__(self) -> None:
        self.free = {GPU: set(gpu_ids(self.topology)), NIC: set(nic_ids(self.topology))}
        self.pools = {kind: Pool(f"test/{kind.value}", kind.value, tuple(sorted(self.free[kind])), self.topology)
                      for kind in (GPU, NIC)}
        servers = [Server(self.pools[kind]) for kind in (GPU, NIC) if kind in self.serves]
        self.allocator = JointAllocator(lambda: servers, clock=lambda: self.now)

    def _facts(self, kind: DeviceKind) -> Partner | None:
        """The other kind's free devices as the kubelet knows them; None when not `exact_free`."""
        other = NIC if kind is GPU else GPU
        if not self.exact_free:
            return None
        return Partner(free=frozenset(self.free[other]) if other in self.serves else None)

    def admit(self, sizes: dict[DeviceKind, int], order: Sequence[DeviceKind]) -> dict[DeviceKind, list[str]]:
        """Allocate one container's resources in `order`; returns the devices it got per kind."""
        got: dict[DeviceKind, list[str]] = {}
        for kind in order:
            size = sizes.get(kind, 0)
            if not size:
                continue
            free = self.free[kind]
            assert len(free) >= size, "the test asked for more than the node has"
            pool = self.pools[kind]
            preferred: list[str] = []
            decision = None
            if kind in self.serves:
                preference = self.allocator.prefer(pool, ContainerRequest(
                    served=pool.ids, available=tuple(sorted(free)), size=size, partner=self._facts(kind)))
                preferred, decision = list(preference.devices), preference.decision
                self.preferences.append((kind, preferred))
            chosen = [device for device in preferred if device in free][:size]
            chosen += sorted(free - set(chosen))[: size - len(chosen)]  # the kubelet's own fallback
            free -= set(chosen)
            if kind in self.serves:
                self.allocator.allocated(pool, chosen, decision)
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
