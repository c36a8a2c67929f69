"""The kubelet's facts for the device plugin's placement: the partner devices of the container under admission,
and the free devices per kind, from `agent.ownership`.

Partner resources are the served pools of the other kind and, when GPUs are not served here (NIC-only mode),
the other plugin's GPU resource (`--gpu-resource-name`). Free devices count only while the ownership reading
is fresh (three poll intervals); an older one, or none, is "unknown" and the allocator keeps its estimate.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from agent.deviceplugin.pools import ResourcePool
from agent.ownership.service import OwnershipService
from agent.placement.policy import DeviceKind

STALE_POLLS = 3


class OwnershipFacts:
    """`partner` is a `server.PartnerLookup`; `known_free` a `joint.KnownFree`."""

    def __init__(self, service: OwnershipService, pools: Callable[[], Iterable[ResourcePool]],
                 gpu_resource_name: str) -> None:
        self.service = service
        self._pools = pools
        self.gpu_resource_name = gpu_resource_name

    def _resources(self, kind: DeviceKind) -> list[str]:
        names = [p.resource_name for p in self._pools() if p.kind == kind.value]
        if kind is DeviceKind.GPU and not names:
            names.append(self.gpu_resource_name)  # GPUs served by another plugin
        return names

    async def partner(self, pool: ResourcePool) -> frozenset[str] | None:
        """Devices of the other kind the container under admission holds; None when not known in time."""
        other = DeviceKind.NIC if pool.kind == DeviceKind.GPU.value else DeviceKind.GPU
        found = await self.service.admission(pool.resource_name, self._resources(other))
        return None if found is None else found.partner_ids

    def known_free(self, kind: DeviceKind) -> frozenset[str] | None:
        """The kubelet's free devices of `kind` at the last fresh reading; None when unknown or stale."""
        latest, read_at = self.service.latest, self.service.read_at
        if latest is None or read_at is None:
            return None
        if self.service.monotonic() - read_at > STALE_POLLS * self.service.poll_interval:
            return None
        free: set[str] = set()
        for resource in self._resources(kind):
            of_resource = latest.free(resource)
            if of_resource is None:
                return None
            free |= {i.partition("::")[0] for i in of_resource}
        return frozenset(free)
