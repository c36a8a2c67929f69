"""Kubernetes Events on the pods that hold a device that turned Unhealthy, so `kubectl describe pod` says why.

One Warning Event per pod holding the device (reason `GpuDeviceUnhealthy` or `NicDeviceUnhealthy`, the message
names the device, the container and the finding: Xid or check), with the pod as involvedObject (kind,
namespace, name and uid, which `kubectl describe` selects on). The holders are the kubelet's now (one
PodResources `List` when the fault arrives, not the last poll's, which can name a pod deleted since or miss one
admitted since); the uid comes from the own-node pod watch or, for a pod the watch has not delivered, one list of
the node's pods. A pod neither knows is gone, and gets no Event. Posted once per pod while the device stays
Unhealthy; a recovery re-arms it. Written in dry-run too: an Event on a pod changes
nothing about it, and it is what a dry-run operator wants to see. API errors are logged, never raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from agent.kube.errors import ApiError
from agent.kube.model import EventRecord, ObjectRef, PodView
from agent.kube.port import EventApi, PodApi
from agent.ownership.book import Holder
from agent.ownership.service import OwnershipService

log = logging.getLogger(__name__)

GPU_REASON = "GpuDeviceUnhealthy"
NIC_REASON = "NicDeviceUnhealthy"


def is_gpu_id(device_id: str) -> bool:
    """GPU and MIG UUIDs (NVIDIA's and the agent's GPU device IDs); everything else here is a NIC bus id."""
    return device_id.startswith(("GPU-", "MIG-"))


class PodEventApi(EventApi, PodApi, Protocol):
    """What pod Events need of the API: write an Event, list the node's pods (uid, existence)."""


class PodDeviceEvents:
    """Posts the Events; `events` None means no API access (nothing is posted, holders are still returned)."""

    def __init__(self, events: PodEventApi | None, ownership: OwnershipService,
                 now: Callable[[], float] = time.time, *, gpu_of: Callable[[str], str | None] | None = None) -> None:
        self.events = events
        self.ownership = ownership
        self._now = now
        self._told: set[tuple[str, str, str]] = set()  # (device, namespace, pod) while the device is Unhealthy
        self.posted = 0
        # the bus id of the GPU a GPU or MIG UUID names (a MIG device's parent), for the Event's text
        self.gpu_of = gpu_of

    def device_healthy(self, device_id: str) -> None:
        """The device recovered: a later fault is reported again."""
        self._told = {t for t in self._told if t[0] != device_id}

    async def device_unhealthy(self, device_id: str, detail: str) -> tuple[Holder, ...] | None:
        """Tell every pod holding `device_id` now; returns the holders, None when the kubelet did not answer
        (then nobody is told: a guess could name the wrong workload)."""
        holders = await self.ownership.holders_now(device_id)
        if holders is None:
            log.warning("no pod Event for unhealthy %s: the kubelet's PodResources did not say who holds it",
                        device_id)
            return None
        listed: dict[tuple[str, str], PodView] | None = None  # the node's pods, listed at most once per fault
        for pod_key in sorted({(h.namespace, h.pod) for h in holders}):
            told = (device_id, *pod_key)
            if told in self._told or self.events is None:
                continue
            pod = self.ownership.pod(*pod_key)
            if pod is None:  # not in the pod watch (lagging, or no watch): ask the API once
                if listed is None:
                    listed = await self._node_pods()
                pod = listed.get(pod_key)
            if pod is None:
                log.info("no %s Event for pod %s/%s: it does not exist any more", device_id, *pod_key)
                continue
            containers = sorted(h.container for h in holders if (h.namespace, h.pod) == pod_key)
            if await self._post(device_id, pod, containers, detail):
                self._told.add(told)
        return holders

    async def _node_pods(self) -> dict[tuple[str, str], PodView]:
        assert self.events is not None
        try:
            return {(p.namespace, p.name): p for p in await self.events.list_pods()}
        except ApiError as exc:
            log.warning("cannot list the node's pods for their uids: %s", exc)
            return {}

    async def _post(self, device_id: str, pod: PodView, containers: list[str], detail: str) -> bool:
        namespace, name = pod.namespace, pod.name
        kind = "GPU" if is_gpu_id(device_id) else "NIC"
        bus_id = self.gpu_of(device_id) if kind == "GPU" and self.gpu_of is not None else None
        where = f" (MIG device of the GPU at {bus_id})" if bus_id and device_id.startswith("MIG-") \
            else f" (at {bus_id})" if bus_id else ""
        message = (f"{kind} {device_id}{where} used by container {', '.join(containers)} is unhealthy: "
                   f"{detail or 'health check failed'}")
        now = self._now()
        record = EventRecord(GPU_REASON if kind == "GPU" else NIC_REASON, message, "Warning",
                             first_time=now, last_time=now,
                             involved=ObjectRef("Pod", namespace, name, pod.uid))
        assert self.events is not None
        try:
            await self.events.write_event(record)
        except ApiError as exc:
            log.warning("cannot post %s on pod %s/%s: %s", record.reason, namespace, name, exc)
            return False
        self.posted += 1
        return True
