"""What a ResourceClaim says about this driver's devices: the allocation results, checked.

`NodePrepareResources` carries only namespace, UID and name; the claim itself is read from the API and its
`status.allocation.devices.results` filtered by driver (`/work/shared/reference/dra.md` sections 2 and 6).
Results of other drivers are left to them. Everything here is parsing: a malformed claim raises `ClaimError`,
whose message goes into the per-claim `error` of the response.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ClaimError(ValueError):
    """A claim this driver cannot prepare; the message is returned to the kubelet."""


@dataclass(frozen=True)
class ClaimRef:
    """The kubelet's handle on a claim."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver: which request, which pool and device."""

    request: str
    pool: str
    device: str

    @property
    def base_request(self) -> str:
        """The claim's request name (a `firstAvailable` subrequest `gpu/h100` reports as `gpu`)."""
        return self.request.split("/", 1)[0]


def allocated_devices(claim: Mapping[str, Any], ref: ClaimRef, driver: str) -> list[AllocatedDevice]:
    """This driver's results of an allocated claim whose UID is the one the kubelet asked for."""
    meta = claim.get("metadata") or {}
    if meta.get("uid") != ref.uid:
        raise ClaimError(f"claim {ref.namespace}/{ref.name} has uid {meta.get('uid')!r}, not {ref.uid!r} "
                         "(deleted and recreated)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(f"claim {ref.namespace}/{ref.name} is not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"claim {ref.namespace}/{ref.name}: allocation results are not a list")
    found = []
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != driver:
            continue
        request, pool, device = (result.get(key) for key in ("request", "pool", "device"))
        if not all(isinstance(v, str) and v for v in (request, pool, device)):
            raise ClaimError(f"claim {ref.namespace}/{ref.name}: an allocation result lacks request, pool or "
                             "device")
        found.append(AllocatedDevice(str(request), str(pool), str(device)))
    return found
