"""The admission context: which devices of the other resource this container was just given.

Why this works: the kubelet admits pods one at a time, and within a container it handles each device
resource completely, GetPreferredAllocation then Allocate, before the next (`kubelet-device-plugin.md`
2.4-2.6). The agent serves both GPUs and RDMA VFs, so when a preference call for one resource arrives just
after an Allocate of the other, that Allocate was for the same container. The servicer records every
Allocate here (`record_allocation`) and, at the start of each preference call, asks for the other kind's
record (`begin_preference`); the policy then aligns with those devices. Records are the devices the kubelet
actually allocated, not our preference, so a kubelet that ignored or filled in our answer is still right.
Whether a preference took a record is the caller's to hand back with that container's Allocate (`completes`,
carried in the joint allocator's `Decision`): the context keeps only the last Allocate's record, no decision.

A record is dropped when it is consumed; when a preference call for its own kind starts (that container had
no other resource served here); when an Allocate of the other kind arrives without a preference call (the
kubelet did not ask: the pair is complete); and after `ttl_s`. The Allocate that completes a consumed pair
is not recorded, so it cannot leak into the next container.

Limits, where the guess is wrong or missing:
- Pods with only one of the two resources: a record left by a NIC-only (or GPU-only) container is handed to
  the next container's preference call for the other kind if it comes within `ttl_s`. The plugin cannot tell
  "same container, second resource" from "next pod" (the API carries no pod identity); the cost is a
  preference aligned with a stranger's devices, never a failure. The servicer can rule this out by looking
  the record's devices up in the PodResources API before using it.
- Two containers of one pod with one resource each, and init containers (admitted first, whose devices the
  app containers may reuse): the second container aligns with the first one's devices.
- Nothing recorded when the kubelet skips GetPreferredAllocation (Topology Manager aligned exactly the
  needed count), and the context only ever covers the last Allocate.
- A plugin restart loses the record (the first container after it is served without context).
- An admission slower than `ttl_s` between the two resources loses the context.

Not locked: the joint allocator calls it from the event loop that serves the gRPC handlers, and no call awaits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agent.placement.policy import DeviceKind

DEFAULT_TTL_S = 5.0


@dataclass(frozen=True)
class _Record:
    kind: DeviceKind
    device_ids: frozenset[str]
    at: float


class AdmissionContext:
    """Hand-over of one container's devices from one resource's Allocate to the other's preference call."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._pending: _Record | None = None

    def begin_preference(self, kind: DeviceKind) -> frozenset[str]:
        """A preference call for `kind` starts: the other kind's devices just allocated (the record is taken), or
        empty."""
        record, self._pending = self._fresh(), None
        if record is None or record.kind == kind:
            return frozenset()
        return record.device_ids

    def record_allocation(self, kind: DeviceKind, device_ids: Iterable[str], *, completes: bool = False) -> None:
        """Allocate for `kind` succeeded with `device_ids`. `completes`: this container's preference call took
        the other kind's record (`begin_preference` returned devices), so this is its second resource."""
        pending = self._fresh()
        if completes or (pending is not None and pending.kind != kind):
            self._pending = None  # the second resource of a container
            return
        self._pending = _Record(kind, frozenset(device_ids), self._clock())

    def _fresh(self) -> _Record | None:
        pending = self._pending
        if pending is not None and self._clock() - pending.at > self._ttl_s:
            self._pending = pending = None
        return pending
