"""Device ownership kept current: a slow poll of the kubelet for metrics and free devices, and a fast,
bounded lookup for the preference path.

The poll (`run`) reads `List` and `GetAllocatableResources` every `poll_interval` seconds (10 s by default:
`gpu_node_agent_device_pod_info` follows the kubelet within 30 s at 4 of the kubelet's 100 calls a second per
minute) and right after `start`, so that after an agent restart the free devices come from the kubelet, not
from an "everything is free" assumption.

`lookup()` (the preference path) sends one `List` and waits `lookup_timeout` for it; it never waits on an older
List (one sent before the call could predate the partner's Allocate). Before the first full reading after a
start (the poll's first may still be on its way when the device plugin registers and the kubelet calls), a
lookup first takes that reading itself, joining the poll's in flight and waiting at most `poll_timeout`: deciding
without it, every device held before the restart looks free, and every container holding a GPU looks like a
new holder (see `Listings`: the first reading is the baseline). That wait is paid once: a lookup after its window
waits for the reading only `lookup_timeout` (a kubelet that accepts and never answers would otherwise cost every
admission `poll_timeout`), and fails as a time-out when it is not in. A reply that comes after the deadline is
not lost: every List reply, on time or late, poll or lookup, becomes `latest` (free devices) and the
`Listings` memory the next call compares with, unless a newer reply is already there. A poll joins a List in
flight instead of sending its own. The container under admission comes from the pod specs when the own-node
pod watch has them, else from the kubelet's records alone (`admitted.new_holders`): exactly one container
newly holding partner devices is it; several leave the choice to the caller (`Lookup.candidates`). Only when
several are left that the caller cannot treat `alike` and some of their pods have no spec yet (the watch lags), and
only with API access, the lookup fetches those specs (`spec_fetch`, one namespaced LIST per pod) within what is
left of its deadline and decides again with them; a fetch answering later is kept for the next call.

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
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from agent import aio
from agent.host.podresources import ContainerDevices, PodResourcesError, PodResourcesPort
from agent.kube.model import PodView
from agent.ownership.admitted import (
    Admission,
    Listings,
    SpecLookup,
    admitted_container,
    new_holders,
    requests_of,
)
from agent.ownership.book import Holder, Ownership
from agent.ownership.metrics import DevicePodInfo
from agent.ownership.spec_fetch import PodSpecFetcher

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 10.0
DEFAULT_LOOKUP_S = 0.05  # ~2x the lookup's p99 with both cores of a 2-core VM busy (bench/podresources_lookup.py)
LATE_S = 2.0  # a lookup's List may still answer this long after its deadline, and teach the next call

PodSpecs = Callable[[], Mapping[tuple[str, str], PodView] | None]  # None: no pod watch (no API access)
Containers = tuple[ContainerDevices, ...]
Alike = Callable[[Sequence[Admission]], bool]  # whether these candidates would be placed the same way

# Why a preference call had no exact partner facts (`gpu_node_agent_preference_fallbacks_total{reason}`)
FALLBACK_REASONS = ("timeout", "rate_limited", "unavailable", "invalid", "ambiguous", "no_new_holder")


@dataclass(frozen=True)
class Lookup:
    """One admission lookup: the container (`found`), or why not (`reason`, a FALLBACK_REASONS value) and, when
    several containers newly hold partner devices, all of them (`candidates`)."""

    found: Admission | None
    reason: str = ""
    candidates: tuple[Admission, ...] = ()


class OwnershipService:
    """Owns the latest `Ownership`, its metric, and the admission lookup."""

    def __init__(self, port: PodResourcesPort, *, pod_specs: PodSpecs | None = None,
                 registry: CollectorRegistry | None = None, poll_interval: float = DEFAULT_POLL_S,
                 lookup_timeout: float = DEFAULT_LOOKUP_S, poll_timeout: float = 2.0,
                 monotonic: Callable[[], float] = time.monotonic, spec_fetcher: PodSpecFetcher | None = None) -> None:
        self.port = port
        self.pod_specs = pod_specs or (lambda: None)
        self.spec_fetcher = spec_fetcher  # None: no API access, the watch's specs or none
        self.poll_interval = poll_interval
        self.lookup_timeout = lookup_timeout
        self.poll_timeout = poll_timeout
        self.monotonic = monotonic
        self.latest: Ownership | None = None
        self.read_at: float | None = None  # monotonic time of `latest`
        self.refreshed = asyncio.Event()
        self.listings = Listings()
        self._inflight: asyncio.Future[Containers] | None = None  # the newest List not answered yet
        self._reading: asyncio.Future[Ownership | None] | None = None  # a full reading in flight (`refresh`)
        self.read_fully = False  # a full reading (List and GetAllocatableResources) succeeded since the start
        self._first_wait_ends: float | None = None  # end of the lookups' first-reading wait (`_first_reading`)
        self._info = DevicePodInfo(lambda: self.latest, registry)
        self._lookups = Counter("gpu_node_agent_pod_resources_lookups",
                                "Admission lookups in the kubelet's PodResources API during preference calls, by "
                                "result: exact (container found), unknown (not identifiable), failed (error or "
                                "time-out: the agent's own policy answered)", ["result"], registry=registry)
        self._fallbacks = Counter("gpu_node_agent_preference_fallbacks",
                                  "Preference calls answered without the container's partner devices, by reason",
                                  ["reason"], registry=registry)
        for reason in FALLBACK_REASONS:
            self._fallbacks.labels(reason)

    def fell_back(self, reason: str) -> None:
        """Count one preference call answered without partner facts (the device plugin decides, see `facts`)."""
        self._fallbacks.labels(reason).inc()

    def _list(self, timeout: float, *, patient: bool, lookup: bool = False, join: bool = False,
              started: float | None = None) -> asyncio.Future[Containers]:
        """A List, or with `join` the one in flight; every reply is remembered (`lookup`: as an admission
        lookup's, see `Listings`). `started`: when the caller's reading began (default now)."""
        inflight = self._inflight
        if join and inflight is not None and not inflight.done():
            return inflight
        sent = self.monotonic() if started is None else started
        task = asyncio.ensure_future(self.port.list(timeout, patient=patient))
        task.add_done_callback(lambda done: self._listed(done, sent, lookup))
        self._inflight = task
        return task

    def _listed(self, done: asyncio.Future[Containers], started: float, lookup: bool) -> None:
        if self._inflight is done:
            self._inflight = None
        if done.cancelled() or done.exception() is not None:
            return  # the caller that waited sees the error; a late failure has nothing to teach
        containers = done.result()
        if self.listings.apply(containers, started, lookup=lookup):
            self.latest = Ownership(containers, self.latest.allocatable if self.latest is not None else {})
            self.read_at = started

    async def refresh(self) -> Ownership | None:
        """Read the kubelet once (`List` and `GetAllocatableResources`), or join the reading in flight; the new
        reading replaces `latest` (kept as it was on failure, then None is returned)."""
        reading = self._reading
        if reading is None or reading.done():
            reading = self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(reading)

    async def _read(self) -> Ownership | None:
        try:
            containers = await asyncio.shield(self._list(self.poll_timeout, patient=True, join=True))
            allocatable = await self.port.allocatable(self.poll_timeout, patient=True)
        except PodResourcesError as exc:
            log.debug("ownership poll: %s", exc)
            return None
        # the reply is in `latest` already, unless a newer one came meanwhile (then that one stays)
        self.latest = Ownership(self.latest.containers if self.latest is not None else containers, allocatable)
        self.read_fully = True
        self.refreshed.set()
        return self.latest

    async def _first_reading(self) -> bool:
        """The full reading a decision after a start needs. The first lookup waits for it at most `poll_timeout`,
        and so do the lookups within that same window; after it, a lookup starts (or joins) the reading and waits
        at most `lookup_timeout`: a kubelet that accepts and never answers costs one first-reading wait, not one
        per call (it would be paid by every admission for as long as the kubelet hangs). True: go on (the
        reading is in, or the kubelet refused at once and the lookup's own List becomes the baseline, see
        `Listings.apply`); False: no answer in time, the lookup fails as a time-out without a List of its own."""
        now = self.monotonic()
        if self._first_wait_ends is None:
            self._first_wait_ends = now + self.poll_timeout
        try:
            if await asyncio.wait_for(self.refresh(), max(self._first_wait_ends - now, self.lookup_timeout)) is None:
                log.debug("admission lookup before the first reading: the kubelet did not answer")
        except TimeoutError:
            log.debug("admission lookup before the first reading: no reading in time")
            return False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`; never raises for a kubelet that is away (that is `pod_resources_up` 0)."""
        try:
            while not stop.is_set():
                await self.refresh()
                await aio.sleep_or_stop(stop, self.poll_interval)
        finally:
            await aio.cancel_and_wait(self._reading)
            if self.spec_fetcher is not None:
                await self.spec_fetcher.aclose()
            await self.port.aclose()

    def holders(self, device_id: str) -> tuple[Holder, ...]:
        """Containers holding `device_id` in the latest poll (empty when unknown): for metrics and logs only."""
        return self.latest.holders(device_id) if self.latest is not None else ()

    async def current(self) -> Ownership | None:
        """One `List` now (bounded by `poll_timeout`, rate-limited with the rest); it also becomes `latest`, keeping
        the last allocatable reading. None when the kubelet does not answer in time."""
        try:
            containers = await asyncio.wait_for(
                asyncio.shield(self._list(self.poll_timeout, patient=True)), self.poll_timeout * 2)
        except (PodResourcesError, TimeoutError) as exc:
            log.warning("cannot read the kubelet's device holders now: %s", exc or "timed out")
            return None
        return Ownership(containers, self.latest.allocatable if self.latest is not None else {})

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
        """The pod spec from the own-node pod watch, or fetched for a preference call when the watch lags."""
        return self._spec_of(self.pod_specs())(namespace, name)

    def _spec_of(self, specs: Mapping[tuple[str, str], PodView] | None) -> SpecLookup:
        fetcher = self.spec_fetcher

        def spec(namespace: str, name: str) -> PodView | None:
            found = specs.get((namespace, name)) if specs is not None else None
            return found if found is not None or fetcher is None else fetcher.spec((namespace, name))
        return spec

    async def admission(self, resource: str, partners: Iterable[str]) -> Admission | None:
        """The container under admission for `resource` and its partner devices; None when not known in time."""
        return (await self.lookup(resource, partners)).found

    async def lookup(self, resource: str, partners: Iterable[str], *, alike: Alike | None = None) -> Lookup:
        """One List (at most), waited on for `lookup_timeout`: the container under admission for `resource`.
        `alike`: whether several candidates lead to the same placement anyway (then no spec is fetched)."""
        partner_names = frozenset(partners)
        if not self.read_fully and not await self._first_reading():  # never decide against "everything is free"
            self._lookups.labels("failed").inc()
            return Lookup(None, "timeout")
        started = self.monotonic()
        listing = self._list(max(LATE_S, self.lookup_timeout), patient=False, lookup=True, started=started)
        try:
            containers = await asyncio.wait_for(asyncio.shield(listing), self.lookup_timeout)
        except (PodResourcesError, TimeoutError) as exc:
            log.debug("admission lookup for %s: %s", resource, exc or "timed out")
            self._lookups.labels("failed").inc()
            return Lookup(None, exc.reason if isinstance(exc, PodResourcesError) else "timeout")
        specs = self.pod_specs()
        fetcher = self.spec_fetcher
        if fetcher is not None:  # keep only what the watch still lacks of pods the kubelet lists
            listed = {(c.namespace, c.pod) for c in containers}
            fetcher.forget(lambda key: key in listed and (specs is None or key not in specs))
        found = self._decide(containers, resource, partner_names, self._spec_of(specs), started)
        if found.reason == "ambiguous" and fetcher is not None and not (alike is not None and alike(found.candidates)):
            spec_of = self._spec_of(specs)
            missing = [(a.namespace, a.pod) for a in found.candidates if spec_of(a.namespace, a.pod) is None]
            if missing:
                await fetcher.fetch(missing, self.lookup_timeout - (self.monotonic() - started))
                found = self._decide(containers, resource, partner_names, self._spec_of(specs), started)
        self._lookups.labels("exact" if found.found is not None else "unknown").inc()
        return found

    def _decide(self, containers: Containers, resource: str, partners: frozenset[str], spec_of: SpecLookup,
                started: float) -> Lookup:
        """The container under admission from one List: by the pod specs, else by the kubelet's records alone."""
        found = admitted_container(containers, resource, partners, spec_of)
        if found is not None:
            return Lookup(found)
        # no spec for the container under admission (no pod watch, or it lags): the kubelet's records alone, less
        # the containers whose spec is known and which do not ask for `resource` (a GPU-only pod)
        def may_be_admitted(listed: ContainerDevices) -> bool:
            wanted = requests_of(spec_of(listed.namespace, listed.pod), listed.container)
            return (wanted is None or resource in wanted) and self.listings.is_new(listed, started) \
                and not self.listings.admission_over(listed)

        holders = tuple(new_holders(containers, resource, partners, may_be_admitted))
        if len(holders) == 1:
            return Lookup(holders[0])
        return Lookup(None, "ambiguous" if holders else "no_new_holder", holders)
