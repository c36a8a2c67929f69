"""The PodResources port: what the kubelet says each container holds, as plain values, and whether it answers.

Consumers (ownership, placement, metrics) never see gRPC: `List` becomes one `ContainerDevices` per container
with its device IDs grouped by resource and de-duplicated (the kubelet sends one entry per device per NUMA
node, podresources.md §0 fact 3), and `GetAllocatableResources` becomes resource -> healthy device IDs. Every
failure (no socket, time-out, rate limit, a reply that does not decode or makes no sense) is one
`PodResourcesError`, so a caller has exactly one thing to fall back on.

`Reachability` is the API's state as an operator sees it: `gpu_node_agent_pod_resources_up` and one log line per
change. An unreachable kubelet is a state, never a crash.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


class PodResourcesError(RuntimeError):
    """The kubelet did not give a usable answer. `reason`: unavailable, timeout, rate_limited, invalid."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"PodResources {reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ContainerDevices:
    """One listed container and the devices the kubelet recorded for it, by resource name."""

    namespace: str
    pod: str
    container: str
    devices: Mapping[str, frozenset[str]]

    @property
    def key(self) -> tuple[str, str, str]:
        """(namespace, pod, container)."""
        return self.namespace, self.pod, self.container

    def of(self, resource: str) -> frozenset[str]:
        """Device IDs of one resource (empty when none is recorded yet)."""
        return self.devices.get(resource, frozenset())


class PodResourcesPort(Protocol):
    """The two RPCs the agent uses; both raise only `PodResourcesError`."""

    async def list(self, timeout: float | None = None, *, patient: bool = False) -> tuple[ContainerDevices, ...]:
        """`List`: every listed container (app and restartable init containers of active pods). `patient`: wait
        for the client's rate limit instead of failing at once (background polls)."""

    async def allocatable(self, timeout: float | None = None, *,
                          patient: bool = False) -> Mapping[str, frozenset[str]]:
        """`GetAllocatableResources`: resource -> healthy device IDs, allocated or not."""

    async def aclose(self) -> None:
        """Release the connection."""


class Reachability:
    """Whether the PodResources API answers: a gauge, and one log line per change (never per call)."""

    def __init__(self, registry: CollectorRegistry | None, where: str) -> None:
        self.where = where
        self.up: bool | None = None  # unknown until the first call
        self._gauge = Gauge("gpu_node_agent_pod_resources_up",
                            "1 when the kubelet's PodResources API answered the agent's last call, 0 when not",
                            registry=registry)
        self._gauge.set(0)

    def succeeded(self) -> None:
        """A call got a usable answer."""
        if self.up is not True:
            log.info("kubelet PodResources API at %s answers", self.where)
        self.up = True
        self._gauge.set(1)

    def failed(self, error: PodResourcesError) -> None:
        """A call failed; a rate-limited call proves the kubelet is there and changes nothing."""
        if error.reason == "rate_limited":
            return
        if self.up is not False:
            log.warning("kubelet PodResources API at %s is unusable (%s); device ownership falls back to the "
                        "agent's own records", self.where, error)
        self.up = False
        self._gauge.set(0)
