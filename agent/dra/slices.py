"""Publish the node's pool as ResourceSlices: split within the API's limits, one generation, stale slices gone.

The pool is named after the node and lives in slices named `<node>-<driver>-<index>` (stable, so a restarted
agent finds and rewrites its own slices instead of adding new ones). A publish that changes anything bumps the
pool generation in every slice and sets `resourceSliceCount`, so consumers (scheduler, Karpenter) can tell a
complete pool; slices the new layout no longer needs are deleted first, as the reference controller does
(`/work/shared/reference/dra.md` section 9). A publish that changes nothing makes no write. The kubelet deletes
every slice of the node at its start, so the service republishes on a timer and after each registration.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.kube.errors import ApiNotFound
from agent.kube.port import ResourceSliceApi

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS = 64
_MAX_NAME = 253


@dataclass(frozen=True)
class PublishResult:
    """What one publish did."""

    changed: bool
    generation: int
    slices: int
    deleted: int = 0


def slice_name(node: str, driver: str, index: int) -> str:
    """`<node>-<driver>-<index>`, hashed down when a long node name would pass the 253-character limit."""
    name = f"{node}-{driver}-{index}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(f"{node}/{driver}".encode()).hexdigest()[:12]
    return f"{node[:200]}-{digest}-{index}"


def split_devices(devices: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Devices in order, cut into slices of at most 128, or 64 once any device carries a taint; one empty slice
    for an empty pool (so the pool still exists and is complete)."""
    limit = MAX_DEVICES_WITH_TAINTS if any(d.get("taints") for d in devices) else MAX_DEVICES
    return [list(devices[i:i + limit]) for i in range(0, len(devices), limit)] or [[]]


def _without_time(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Devices with the server-filled taint `timeAdded` dropped, for comparing what we mean with what is there."""
    return [{**device, "taints": [{k: v for k, v in t.items() if k != "timeAdded"} for t in device["taints"]]}
            if device.get("taints") else device for device in devices]


def _carry_time_added(devices: list[dict[str, Any]], before: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the `timeAdded` the server gave a taint that is still there (the helper's copyTaintTimeAdded)."""
    out = []
    for device in devices:
        old = before.get(device["name"])
        if not device.get("taints") or old is None:
            out.append(device)
            continue
        times = {(t.get("key"), t.get("value"), t.get("effect")): t.get("timeAdded") for t in old.get("taints") or []}
        taints = []
        for taint in device["taints"]:
            added = times.get((taint.get("key"), taint.get("value"), taint.get("effect")))
            taints.append({**taint, "timeAdded": added} if added else taint)
        out.append({**device, "taints": taints})
    return out


class SlicePublisher:
    """Keeps this node's slices of one driver equal to a device list."""

    def __init__(self, api: ResourceSliceApi, driver: str) -> None:
        self._api = api
        self.driver = driver
        self.node = api.node_name
        self._node_uid = ""

    def _body(self, index: int, devices: list[dict[str, Any]], generation: int, count: int,
              resource_version: str = "") -> dict[str, Any]:
        meta: dict[str, Any] = {"name": slice_name(self.node, self.driver, index),
                                "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.node,
                                                     "uid": self._node_uid, "controller": True}]}
        if resource_version:
            meta["resourceVersion"] = resource_version
        return {"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": meta,
                "spec": {"driver": self.driver, "nodeName": self.node,
                         "pool": {"name": self.node, "generation": generation, "resourceSliceCount": count},
                         "devices": devices}}

    @staticmethod
    def _same(existing: dict[str, dict[str, Any]], wanted: list[list[dict[str, Any]]], names: list[str]) -> bool:
        if set(existing) != set(names):
            return False
        generations = {s["spec"]["pool"].get("generation") for s in existing.values()}
        counts = {s["spec"]["pool"].get("resourceSliceCount") for s in existing.values()}
        if len(generations) != 1 or counts != {len(names)}:
            return False
        return all(_without_time(existing[name]["spec"].get("devices") or []) == _without_time(devices)
                   for name, devices in zip(names, wanted, strict=True))

    async def publish(self, devices: Sequence[dict[str, Any]]) -> PublishResult:
        """Make the slices match `devices`; API errors propagate (the caller retries with backoff)."""
        existing = {s["metadata"]["name"]: s for s in await self._api.list_resource_slices(self.driver)
                    if s["spec"].get("nodeName") == self.node and s["spec"].get("driver") == self.driver}
        wanted = split_devices(devices)
        names = [slice_name(self.node, self.driver, i) for i in range(len(wanted))]
        generation = max((int(s["spec"]["pool"].get("generation") or 0) for s in existing.values()), default=0)
        if self._same(existing, wanted, names):
            return PublishResult(False, generation, len(names))
        if not self._node_uid:
            self._node_uid = await self._api.node_uid()
        generation += 1
        stale = [name for name in existing if name not in names]
        for name in stale:  # first, so no consumer sees more slices than resourceSliceCount at the new generation
            with contextlib.suppress(ApiNotFound):
                await self._api.delete_resource_slice(name)
        before = {d["name"]: d for s in existing.values() for d in s["spec"].get("devices") or []}
        for index, (name, devices_here) in enumerate(zip(names, wanted, strict=True)):
            chunk = _carry_time_added(devices_here, before)
            current = existing.get(name)
            if current is None:
                await self._api.create_resource_slice(self._body(index, chunk, generation, len(names)))
            else:
                await self._api.replace_resource_slice(self._body(
                    index, chunk, generation, len(names), current["metadata"].get("resourceVersion", "")))
        log.info("DRA: published %d devices in %d ResourceSlices (pool %s generation %d, %d stale deleted)",
                 len(devices), len(names), self.node, generation, len(stale))
        return PublishResult(True, generation, len(names), len(stale))
