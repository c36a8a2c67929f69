"""Prepare and unprepare claims: read the claim, check its devices, write the CDI spec, remember it.

The rules the kubelet plugin helper enforces (`/work/shared/reference/dra.md` section 2), for a driver not in Go:
one call at a time (an asyncio lock: the kubelet may call again while a slow API read is in flight; and a file
lock in the state dir, re-reading the record under it, for a second agent process in a rolling update); both
calls idempotent (a claim already prepared answers from the record, its spec rewritten if the runtime's
directory lost it); the record persisted before the answer; a device prepared for another claim, a device of
another node's pool, and a device this node does not have are refused with an error for that claim only.
Unprepare works from the record alone, and also removes a spec left by a crash before the record was written.

Deadlines add up to less than the kubelet's 45 s: one call has one overall deadline (`deadline`, 40 s). The
claims it needs are read concurrently (at most `MAX_CONCURRENT_READS` at a time, within the deadline less 5 s
kept for the local work) *before* the lock is taken, so a slow API read never holds another pod's call; a claim
whose read has not finished in time gets an error of its own (the kubelet retries), and the others are answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.dra.cdi import CdiError, CdiSpecs
from agent.dra.claims import AllocatedDevice, ClaimError, ClaimRef, allocated_devices
from agent.dra.devices import DraDevice, share_hardware
from agent.dra.state import LockTimeout, PreparedClaim, PreparedDevice, PreparedStore, StateUnreadable, serialized
from agent.kube.errors import ApiError, ApiNotFound
from agent.kube.port import ResourceClaimApi

log = logging.getLogger(__name__)

CALL_DEADLINE_SECONDS = 40.0  # one prepare/unprepare call, inside the kubelet's 45 s
MAX_CONCURRENT_READS = 16
LOCAL_RESERVE_SECONDS = 5.0  # of the deadline, kept from the claim reads for the lock, the specs and the record
_Read = dict[str, Any] | BaseException


@dataclass(frozen=True)
class Outcome:
    """One claim's answer: its devices, or an error."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimPreparer:
    """The driver's side of NodePrepareResources / NodeUnprepareResources, independent of the gRPC version."""

    def __init__(self, claims: ResourceClaimApi, *, driver: str, pool: str, store: PreparedStore, cdi: CdiSpecs,
                 devices: Callable[[], Mapping[str, DraDevice]],
                 observe: Callable[[str, bool], None] = lambda call, ok: None,
                 deadline: float = CALL_DEADLINE_SECONDS) -> None:
        self._claims = claims
        self.driver = driver
        self.pool = pool
        self.store = store
        self.cdi = cdi
        self._devices = devices  # the current pool by device name (rescans replace it)
        self._observe = observe  # (call, ok) per claim, for the metrics
        self._lock = asyncio.Lock()
        self.deadline = deadline

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        """One outcome per claim UID; never raises for a bad claim."""
        until = asyncio.get_running_loop().time() + self.deadline
        reads = await self._read_claims(refs, until)  # outside the lock: a slow read holds no other call

        async def one(ref: ClaimRef) -> Outcome:
            return await self._prepare_one(ref, reads.get(ref.uid), until)

        return await self._serialized("prepare", one, refs, until)

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, Outcome]:
        """One outcome per claim UID; unknown claims succeed (the kubelet retries after restarts)."""
        until = asyncio.get_running_loop().time() + self.deadline
        return await self._serialized("unprepare", self._unprepare_one, refs, until)

    async def _read_claims(self, refs: list[ClaimRef], until: float) -> dict[str, _Read]:
        """The claims not prepared yet, read concurrently; what did not finish by `until` is a ClaimError."""
        wanted = {ref.uid: ref for ref in refs
                  if ref.uid and ref.name and ref.namespace and ref.uid not in self.store.claims}
        if not wanted:
            return {}
        gate = asyncio.Semaphore(MAX_CONCURRENT_READS)

        async def read(ref: ClaimRef) -> dict[str, Any]:
            async with gate:
                return await self._claims.get_resource_claim(ref.namespace, ref.name)

        tasks = {uid: asyncio.create_task(read(ref)) for uid, ref in wanted.items()}
        reserve = min(LOCAL_RESERVE_SECONDS, self.deadline / 4)  # time left for the lock, specs and the record
        remaining = max(0.0, until - reserve - asyncio.get_running_loop().time())
        try:
            await asyncio.wait(tasks.values(), timeout=remaining)
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        out: dict[str, _Read] = {}
        for uid, task in tasks.items():
            if not task.cancelled():
                out[uid] = task.exception() or task.result()
            else:
                out[uid] = ClaimError(f"reading claim {wanted[uid].namespace}/{wanted[uid].name} did not finish "
                                      f"within the call's {self.deadline:.0f} s; the kubelet retries")
        return out

    async def _serialized(self, call: str, one: Callable[[ClaimRef], Awaitable[Outcome]],
                          refs: list[ClaimRef], until: float) -> dict[str, Outcome]:
        try:
            remaining = max(0.0, until - asyncio.get_running_loop().time())
            if self._lock.locked():
                await asyncio.wait_for(self._lock.acquire(), remaining)
            else:
                await self._lock.acquire()
        except TimeoutError:
            message = f"{call}: another call held the driver past this call's {self.deadline:.0f} s"
            log.error("DRA: %s", message)
            outcomes = {ref.uid: Outcome(error=message) for ref in refs}
        else:
            try:
                remaining = max(0.0, until - asyncio.get_running_loop().time())
                async with serialized(self.store.lock_path, timeout=remaining):
                    self.store.reload()
                    outcomes = {ref.uid: await self._guard(one, ref) for ref in refs}
            except LockTimeout as exc:  # the kubelet retries; every claim says why
                log.error("DRA: %s: %s", call, exc)
                outcomes = {ref.uid: Outcome(error=str(exc)) for ref in refs}
            finally:
                self._lock.release()
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

    async def _prepare_one(self, ref: ClaimRef, read: _Read | None, until: float) -> Outcome:
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
            if read is None:  # not read before the lock (the record named it then): read now, within the deadline
                remaining = max(0.0, until - asyncio.get_running_loop().time())
                try:
                    read = await asyncio.wait_for(self._claims.get_resource_claim(ref.namespace, ref.name),
                                                  remaining)
                except TimeoutError:
                    raise ClaimError(f"reading claim {ref.namespace}/{ref.name} did not finish within the "
                                     f"call's {self.deadline:.0f} s; the kubelet retries") from None
            if isinstance(read, BaseException):
                raise read
            claim = read
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
            # a whole GPU and its MIG devices are never published together, but a repartition between one claim's
            # prepare and its unprepare could offer the other form of a GPU still held: refuse it as held
            owner = self.store.owner(result.pool, result.device, share_hardware)
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
