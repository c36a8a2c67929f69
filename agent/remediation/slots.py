"""K remediation slots as Leases: a fleet-wide cap on cordons without a central controller.

draino cordoned whole clusters (planetlabs/draino#54, #89); AKS repairs one node at a time. Here a node must
hold one of K Leases (`gpu-remediation-slot-0..K-1` in one namespace) before it cordons. Taking a slot is a
create (409 if another node created it first) or a resourceVersion-guarded replace of an expired Lease (409 if
another node won), so two agents never both believe they hold one. Holder identity is the node name, so a
restarted agent finds its own slot. A held slot is renewed at a third of its duration and released on
uncordon. One LIST finds the free slots; the scan starts at an offset derived from the node name to spread
contention.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib

from agent.clock import Clock
from agent.kube.errors import ApiConflict, ApiNotFound
from agent.kube.model import LeaseView
from agent.kube.port import LeaseApi
from agent.remediation.metrics import ActionCounter

log = logging.getLogger(__name__)

SLOT_NAME = "gpu-remediation-slot-{index}"
#: Tolerated clock skew between nodes when judging another node's Lease expired.
SKEW_SECONDS = 30.0


class Slots:
    """Acquire, renew and release this node's remediation slot."""

    def __init__(self, api: LeaseApi, clock: Clock, actions: ActionCounter, *, namespace: str, count: int,
                 holder: str, lease_seconds: float, label: str, dry_run: bool = False) -> None:
        self._api = api
        self._clock = clock
        self._actions = actions
        self.namespace = namespace
        self.count = count
        self.holder = holder
        self._duration = lease_seconds
        self._labels = {label: "true"}
        self._dry_run = dry_run
        self.held: LeaseView | None = None

    def _order(self) -> list[str]:
        start = zlib.crc32(self.holder.encode()) % self.count
        return [SLOT_NAME.format(index=(start + i) % self.count) for i in range(self.count)]

    def _expired(self, lease: LeaseView, now: float) -> bool:
        return not lease.holder or lease.renew_time is None or lease.renew_time + lease.duration + SKEW_SECONDS <= now

    async def find_own(self) -> LeaseView | None:
        """After a restart: the slot this node still holds, if any."""
        leases = await self._api.list_leases(self.namespace, self._labels)
        self.held = next((le for le in leases if le.holder == self.holder), None)
        return self.held

    async def acquire(self) -> str | None:
        """Hold a slot (the one already held, or a free one); None when all K are held by other nodes."""
        if self.held is not None:
            return self.held.name
        now = self._clock.now()
        leases = {le.name: le for le in await self._api.list_leases(self.namespace, self._labels)}
        mine = next((le for le in leases.values() if le.holder == self.holder), None)
        candidates = [mine.name] if mine is not None else self._order()
        for name in candidates:
            current = leases.get(name)
            if current is not None and current.holder != self.holder and not self._expired(current, now):
                continue
            if self._dry_run:
                self.held = LeaseView(name, self.holder, self._duration, now, now, labels=self._labels)
                self._actions.count("slot", "dry_run")
                log.info("dry-run: would take remediation slot %s/%s", self.namespace, name)
                return name
            try:
                self.held = await self._api.write_lease(self.namespace, self._taken(name, current, now))
            except ApiConflict:
                continue  # another node got there first
            self._actions.count("slot", "acquired")
            log.info("took remediation slot %s/%s", self.namespace, name)
            return name
        self._actions.count("slot", "none_free")
        return None

    def _taken(self, name: str, current: LeaseView | None, now: float) -> LeaseView:
        if current is None:
            return LeaseView(name, self.holder, self._duration, now, now, 0, "", self._labels)
        transitions = current.transitions + (0 if current.holder == self.holder else 1)
        return dataclasses.replace(current, holder=self.holder, duration=self._duration, renew_time=now,
                                   acquire_time=now if current.holder != self.holder else current.acquire_time,
                                   transitions=transitions, labels=self._labels)

    def renew_due_at(self) -> float | None:
        """When the held slot should next be renewed."""
        if self.held is None or self._dry_run:
            return None
        return (self.held.renew_time or 0.0) + self._duration / 3

    async def renew(self) -> None:
        """Renew the held slot if due. Losing it (someone else took it after expiry) is logged, not fatal."""
        due = self.renew_due_at()
        if self.held is None or due is None or self._clock.now() < due:
            return
        try:
            self.held = await self._api.write_lease(
                self.namespace, dataclasses.replace(self.held, renew_time=self._clock.now()))
        except (ApiConflict, ApiNotFound):
            lost = self.held.name
            self.held = None
            if await self.find_own() is None:
                self._actions.count("slot", "lost")
                log.warning("remediation slot %s was taken by another node; the cordon stays", lost)

    async def release(self) -> None:
        """Give the slot back (holder cleared) so another node can remediate."""
        held = self.held
        if held is None:
            return
        if self._dry_run:
            self.held = None
            return
        try:
            await self._api.write_lease(self.namespace, dataclasses.replace(held, holder="", renew_time=None))
        except (ApiConflict, ApiNotFound):
            log.info("remediation slot %s already changed hands", held.name)
        else:
            self._actions.count("slot", "released")
            log.info("released remediation slot %s/%s", self.namespace, held.name)
        self.held = None
