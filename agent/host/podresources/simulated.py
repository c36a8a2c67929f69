"""The kubelet's device records in memory, and the PodResources port that reads them directly.

`DeviceRecords` is what the kubelet's device manager knows, in the shape PodResources reports it: active pods
(added before their admission starts, like the pod manager), each container's devices per resource (recorded
after each Allocate), and the healthy devices per resource. The stand-in kubelet (`agent.simulate.kubelet`)
keeps one and serves it over a real unix socket; `InMemoryPodResources` is the twin of the gRPC client for
`--simulate` runs and unit tests, with the same errors (`available = False`, `garbage = True`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agent.host.podresources.port import ContainerDevices, PodResourcesError, Reachability


@dataclass
class PodRecord:
    """One active pod: its listed containers in spec order, each resource -> device IDs."""

    namespace: str
    name: str
    containers: dict[str, dict[str, list[str]]] = field(default_factory=dict)


class DeviceRecords:
    """Active pods and their devices; `healthy` gives resource -> healthy device IDs (allocatable)."""

    def __init__(self, healthy: Callable[[], Mapping[str, frozenset[str]]] | None = None) -> None:
        self.pods: dict[tuple[str, str], PodRecord] = {}
        self.healthy = healthy or dict

    def add_pod(self, namespace: str, name: str, containers: list[str]) -> PodRecord:
        """The pod becomes active (before admission), its listed containers with no devices yet."""
        record = PodRecord(namespace, name, {c: {} for c in containers})
        self.pods[(namespace, name)] = record
        return record

    def record(self, namespace: str, pod: str, container: str, resource: str, device_ids: list[str]) -> None:
        """Allocate for one resource of a container succeeded (a non-listed container is not recorded)."""
        record = self.pods.get((namespace, pod))
        if record is not None and container in record.containers:
            record.containers[container].setdefault(resource, []).extend(device_ids)

    def remove_pod(self, namespace: str, name: str) -> None:
        """The pod is no longer active: its records go."""
        self.pods.pop((namespace, name), None)

    def held(self, resource: str) -> set[str]:
        """Devices of `resource` recorded for any active container."""
        return {i for pod in self.pods.values() for c in pod.containers.values() for i in c.get(resource, ())}

    def containers(self) -> tuple[ContainerDevices, ...]:
        """What `List` reports."""
        return tuple(ContainerDevices(pod.namespace, pod.name, name,
                                      {r: frozenset(ids) for r, ids in devices.items() if ids})
                     for pod in self.pods.values() for name, devices in pod.containers.items())


class InMemoryPodResources:
    """`PodResourcesPort` over `DeviceRecords`, without a socket."""

    def __init__(self, records: DeviceRecords, reachability: Reachability | None = None) -> None:
        self.records = records
        self.reachability = reachability
        self.available = True
        self.garbage = False
        self.calls = 0

    def _check(self) -> None:
        self.calls += 1
        error = None
        if not self.available:
            error = PodResourcesError("unavailable", "the simulated kubelet is down")
        elif self.garbage:
            error = PodResourcesError("invalid", "the simulated kubelet answered garbage")
        if error is not None:
            if self.reachability is not None:
                self.reachability.failed(error)
            raise error
        if self.reachability is not None:
            self.reachability.succeeded()

    async def list(self, timeout: float | None = None, *, patient: bool = False) -> tuple[ContainerDevices, ...]:
        """`List` from memory."""
        self._check()
        return self.records.containers()

    async def allocatable(self, timeout: float | None = None, *,
                          patient: bool = False) -> Mapping[str, frozenset[str]]:
        """`GetAllocatableResources` from memory."""
        self._check()
        return dict(self.records.healthy())

    async def aclose(self) -> None:
        """Nothing to release."""
