"""Device ownership kept current: a slow poll of the kubelet for metrics and free devices, and a fast,
bounded lookup for the preference path.

The poll (`run`) reads `List` and `GetAllocatableResources` every `poll_interval` seconds (10 s by default:
`gpu_node_agent_device_pod_info` follows the kubelet within 30 s at 4 of the kubelet's 100 calls a second per
minute) and right after `start`, so that after an agent restart the free devices come from the kubelet, not
from an "everything is free" assumption. `admission()` is one `List` with a deadline of `lookup_timeout`
(a few milliseconds): it answers None on any failure, and the caller keeps its own policy.

Decisions that name pods by device (isolate: who holds it, is the drain over; pod Events; a GPU reset's "no pod
holds it") never use the poll's reading, which can be `poll_interval` old and miss a pod admitted since or name one
deleted since: they call `holders_now`/`pods_holding_now`, one `List` at decision time, bounded by `poll_timeout`
and taking its token from the same rate limit as every other call. None means the kubelet did not answer: the
caller must treat the holders as unknown, never as "nobody".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

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
        """Containers holding `device_id` in the latest poll (empty when unknown): for metrics and logs only."""
        return self.latest.holders(device_id) if self.latest is not None else ()

    async def current(self) -> Ownership | None:
        """One `List` now (bounded by `poll_timeout`, rate-limited with the rest); it also becomes `latest`, keeping
        the last allocatable reading. None when the kubelet does not answer in time."""
        try:
            containers = await asyncio.wait_for(self.port.list(self.poll_timeout, patient=True),
                                                self.poll_timeout * 2)
        except (PodResourcesError, TimeoutError) as exc:
            log.warning("cannot read the kubelet's device holders now: %s", exc or "timed out")
            return None
        self.latest = Ownership(containers, self.latest.allocatable if self.latest is not None else {})
        self.read_at = self.monotonic()
        return self.latest

    async def holders_now(self, device_id: str) -> tuple[Holder, ...] | None:
        """Containers holding `device_id` according to the kubelet now; None when it cannot be asked."""
        reading = await self.current()
        return None if reading is None else reading.holders(device_id)

    async def pods_holding_now(self, device_ids: Sequence[str]) -> list[str] | None:
        """"namespace/name" of every pod holding one of `device_ids` according to the kubelet now, sorted; None
        when it cannot be asked."""
        reading = await self.current()
        if reading is None:
            return None
        return sorted({f"{h.namespace}/{h.pod}" for d in device_ids for h in reading.holders(d)})

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
