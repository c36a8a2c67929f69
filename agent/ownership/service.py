"""Device ownership kept current: a slow poll of the kubelet for metrics and free devices, and a fast,
bounded lookup for the preference path.

The poll (`run`) reads `List` and `GetAllocatableResources` every `poll_interval` seconds (10 s by default:
`gpu_node_agent_device_pod_info` follows the kubelet within 30 s at 4 of the kubelet's 100 calls a second per
minute) and right after `start`, so that after an agent restart the free devices come from the kubelet, not
from an "everything is free" assumption. `admission()` is one `List` with a deadline of `lookup_timeout`
(a few milliseconds): it answers None on any failure, and the caller keeps its own policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter

from agent import aio
from agent.host.podresources import PodResourcesError, PodResourcesPort
from agent.kube.model import PodView
from agent.ownership.admitted import Admission, admitted_container
from agent.ownership.book import Holder, Ownership
from agent.ownership.metrics import DevicePodInfo

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 10.0
DEFAULT_LOOKUP_S = 0.005

PodSpecs = Callable[[], Mapping[tuple[str, str], PodView] | None]  # None: no pod watch (no API access)


class OwnershipService:
    """Owns the latest `Ownership`, its metric, and the admission lookup."""

    def __init__(self, port: PodResourcesPort, *, pod_specs: PodSpecs | None = None,
                 registry: CollectorRegistry | None = None, poll_interval: float = DEFAULT_POLL_S,
                 lookup_timeout: float = DEFAULT_LOOKUP_S, poll_timeout: float = 2.0,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.port = port
        self.pod_specs = pod_specs or (lambda: None)
        self.poll_interval = poll_interval
        self.lookup_timeout = lookup_timeout
        self.poll_timeout = poll_timeout
        self.monotonic = monotonic
        self.latest: Ownership | None = None
        self.read_at: float | None = None  # monotonic time of `latest`
        self.refreshed = asyncio.Event()
        self._info = DevicePodInfo(lambda: self.latest, registry)
        self._lookups = Counter("gpu_node_agent_pod_resources_lookups",
                                "Admission lookups in the kubelet's PodResources API during preference calls, by "
                                "result: exact (container found), unknown (not identifiable), failed (error or "
                                "time-out: the agent's own policy answered)", ["result"], registry=registry)

    async def refresh(self) -> Ownership | None:
        """Read the kubelet once; the new reading replaces `latest` (kept as it was on failure)."""
        try:
            containers = await self.port.list(self.poll_timeout, patient=True)
            allocatable = await self.port.allocatable(self.poll_timeout, patient=True)
        except PodResourcesError as exc:
            log.debug("ownership poll: %s", exc)
            return None
        self.latest = Ownership(containers, allocatable)
        self.read_at = self.monotonic()
        self.refreshed.set()
        return self.latest

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`; never raises for a kubelet that is away (that is `pod_resources_up` 0)."""
        try:
            while not stop.is_set():
                await self.refresh()
                await aio.sleep_or_stop(stop, self.poll_interval)
        finally:
            await self.port.aclose()

    def holders(self, device_id: str) -> tuple[Holder, ...]:
        """Containers holding `device_id` in the latest reading (empty when unknown)."""
        return self.latest.holders(device_id) if self.latest is not None else ()

    def pods_holding(self, device_ids: Iterable[str]) -> list[str]:
        """"namespace/name" of every pod holding one of `device_ids` in the latest reading, sorted."""
        return sorted({f"{h.namespace}/{h.pod}" for d in device_ids for h in self.holders(d)})

    def pod(self, namespace: str, name: str) -> PodView | None:
        """The pod spec from the own-node pod watch, when there is one."""
        specs = self.pod_specs()
        return specs.get((namespace, name)) if specs is not None else None

    async def admission(self, resource: str, partners: Iterable[str]) -> Admission | None:
        """The container under admission for `resource` and its partner devices; None when not known in time."""
        specs = self.pod_specs()
        if specs is None:
            self._lookups.labels("unknown").inc()
            return None
        try:
            containers = await asyncio.wait_for(self.port.list(self.lookup_timeout), self.lookup_timeout * 2)
        except (PodResourcesError, TimeoutError) as exc:
            log.debug("admission lookup for %s: %s", resource, exc)
            self._lookups.labels("failed").inc()
            return None
        found = admitted_container(containers, resource, partners, lambda ns, name: specs.get((ns, name)))
        self._lookups.labels("exact" if found is not None else "unknown").inc()
        return found
