"""One reading of the kubelet's device records: which container holds which device, and which are free.

Built from `List` (held devices per container) and `GetAllocatableResources` (healthy devices per resource);
free = healthy and held by no listed container. A device can be held by several containers (GPU sharing
replicas, init-container reuse), so `holders` returns all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.host.podresources import ContainerDevices


@dataclass(frozen=True)
class Holder:
    """One container holding a device of one resource."""

    namespace: str
    pod: str
    container: str
    resource: str


@dataclass(frozen=True)
class Ownership:
    """The kubelet's device records at one moment; `allocatable` is empty when it was not read."""

    containers: tuple[ContainerDevices, ...]
    allocatable: Mapping[str, frozenset[str]] = field(default_factory=dict)

    def holders(self, device_id: str) -> tuple[Holder, ...]:
        """Every container holding `device_id`, of any resource; a shared GPU's replicas (`<uuid>::<n>`, NVIDIA's
        time-slicing and MPS IDs) count as the GPU."""
        return tuple(Holder(c.namespace, c.pod, c.container, resource)
                     for c in self.containers for resource, ids in c.devices.items()
                     if any(i == device_id or i.partition("::")[0] == device_id for i in ids))

    def held(self, resource: str) -> frozenset[str]:
        """Devices of `resource` held by any listed container."""
        return frozenset(i for c in self.containers for i in c.of(resource))

    def free(self, resource: str) -> frozenset[str] | None:
        """Healthy devices of `resource` that no container holds; None when the kubelet did not say."""
        if resource not in self.allocatable:
            return None
        return self.allocatable[resource] - self.held(resource)

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        """(resource, device, namespace, pod, container) for every held device, sorted."""
        return sorted({(r, i, c.namespace, c.pod, c.container)
                       for c in self.containers for r, ids in c.devices.items() for i in ids})
