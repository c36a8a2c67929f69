"""Prepare and unprepare claims: read the claim, check its devices, write the CDI spec, remember it.

The rules the kubelet plugin helper enforces (`/work/shared/reference/dra.md` section 2), for a driver not in Go:
one call at a time (an asyncio lock: the kubelet may call again while a slow API read is in flight; and a file
lock in the state dir, re-reading the record under it, for a second agent process in a rolling update); both
calls idempotent (a claim already prepared answers from the record, its spec rewritten if the runtime's
directory lost it); the record persisted before the answer; a device prepared for another claim, a device of
another node's pool, and a device this node does not have are refused with an error for that claim only.
Unprepare works from the record alone, and also removes a spec left by a crash before the record was written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from agent.dra.cdi import CdiError, CdiSpecs
from agent.dra.claims import AllocatedDevice, ClaimError, ClaimRef, allocated_devices
from agent.dra.devices import DraDevice
from agent.dra.state import LockTimeout, PreparedClaim, PreparedDevice, PreparedStore, StateUnreadable, serialized
from agent.kube.errors import ApiError, ApiNotFound
from agent.kube.port import ResourceClaimApi

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """One claim's answer: its devices, or an error."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimPreparer:
    """The driver's side of NodePrepareResources / NodeUnprepareResources, independent of the gRPC version."""

    def __init__(self, claims: ResourceClaimApi, *, driver: str, pool: str, store: PreparedStore, cdi: CdiSpecs,
                 devices: Callable[[], Mapping[str, DraDevice]],
                 observe: Callable[[str, bool], None] = lambda call, ok: None) -> None:
        self._claims = claims
        self.driver = driver
        self.pool = pool
        self.store = store
        self.cdi = cdi
        self._devices = devices  # the current pool by device name (rescans replace it)
        self._observe = observe  # (call, ok) per claim, for the metrics
        self._lock = asyncio.Lock()

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        """One outcome per claim UID; never raises for a bad claim."""
        return await self._serialized("prepare", self._prepare_one, refs)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        """One outcome per claim UID; unknown claims succeed (the kubelet retries after restarts)."""
        return await self._serialized("unprepare", self._unprepare_one, refs)

    async def _serialized(self, call: str, one: Callable[[ClaimRef], Awaitable[Outcome]],
                          refs: list[ClaimRef]) -> dict[str, Outcome]:
        try:
            async with self._lock, serialized(self.store.lock_path):
                self.store.reload()
                outcomes = {ref.uid: await self._guard(one, ref) for ref in refs}
        except LockTimeout as exc:  # the kubelet retries; every claim says why
            log.error("DRA: %s: %s", call, exc)
            outcomes = {ref.uid: Outcome(error=str(exc)) for ref in refs}
        for outcome in outcomes.values():
            self._observe(call, not outcome.error)
        return outcomes

    async def _guard(self, call: Callable[[ClaimRef], Awaitable[Outcome]], ref: ClaimRef) -> Outcome:
        try:
            return await call(ref)
        except (ClaimError, CdiError, StateUnreadable) as exc:
            log.warning("DRA: claim %s/%s (%s) refused: %s", ref.namespace, ref.name, ref.uid, exc)
            return Outcome(error=str(exc))
        except ApiError as exc:
            log.warning("DRA: claim %s/%s: API error: %s", ref.namespace, ref.name, exc)
            return Outcome(error=f"reading the claim failed: {exc}")
        except OSError as exc:
            log.error("DRA: claim %s/%s: cannot write CDI spec or state: %s", ref.namespace, ref.name, exc)
            return Outcome(error=f"node-local write failed: {exc.strerror or exc}")
        except Exception as exc:  # a bug for one claim must not fail the others or the server
            log.exception("DRA: claim %s/%s: unexpected failure", ref.namespace, ref.name)
            return Outcome(error=f"internal error: {type(exc).__name__}")

    async def _prepare_one(self, ref: ClaimRef) -> Outcome:
        if self.store.problem is not None:  # fail closed: a device of the lost record may be held
            raise StateUnreadable(f"prepared-claims state {self.store.path} is unreadable ({self.store.problem}): "
                                  "devices in unknown use, nothing is prepared until it is repaired or removed")
        if not ref.uid or not ref.name or not ref.namespace:
            raise ClaimError("a claim needs namespace, uid and name")
        self.cdi.path(ref.uid)  # CdiError for a uid that is no UUID, before anything is read or written
        known = self.store.claims.get(ref.uid)
        if known is not None:
            self._rewrite_if_lost(ref.uid, known)
            return Outcome(known.devices)
        try:
            claim = await self._claims.get_resource_claim(ref.namespace, ref.name)
        except ApiNotFound as exc:
            raise ClaimError(f"claim {ref.namespace}/{ref.name} not found") from exc
        results = allocated_devices(claim, ref, self.driver)
        devices = self._check(ref, results)
        ids = self.cdi.write(ref.uid, devices) if devices else []
        prepared = tuple(PreparedDevice((r.base_request,), r.pool, r.device, (cdi_id,))
                         for r, cdi_id in zip(results, ids, strict=True))
        self.store.put(ref.uid, PreparedClaim(ref.namespace, ref.name, prepared))
        log.info("DRA: prepared claim %s/%s: %s", ref.namespace, ref.name, ", ".join(r.device for r in results))
        return Outcome(prepared)

    def _check(self, ref: ClaimRef, results: list[AllocatedDevice]) -> list[DraDevice]:
        pool = self._devices()
        devices = []
        for result in results:
            if result.pool != self.pool:
                raise ClaimError(f"device {result.device} is in pool {result.pool!r}, not this node's "
                                 f"({self.pool!r})")
            device = pool.get(result.device)
            if device is None:
                raise ClaimError(f"device {result.device} is not a device of this node")
            owner = self.store.owner(result.pool, result.device)
            if owner is not None and owner != ref.uid:
                raise ClaimError(f"device {result.device} is already prepared for claim {owner}")
            if device in devices:
                raise ClaimError(f"device {result.device} is allocated twice in the claim")
            devices.append(device)
        return devices

    def _rewrite_if_lost(self, uid: str, known: PreparedClaim) -> None:
        """A reboot empties /var/run/cdi while the record in the state dir stays: write the spec again."""
        if not known.devices or self.cdi.path(uid).exists():
            return
        pool = self._devices()
        devices = [pool[d.device] for d in known.devices if d.device in pool]
        if len(devices) != len(known.devices):
            raise ClaimError(f"claim {known.namespace}/{known.name}: a prepared device is gone from this node")
        self.cdi.write(uid, devices)

    async def _unprepare_one(self, ref: ClaimRef) -> Outcome:
        self.cdi.remove(ref.uid)
        claim = self.store.remove(ref.uid)
        if claim is not None:
            log.info("DRA: unprepared claim %s/%s", claim.namespace, claim.name)
        return Outcome()
