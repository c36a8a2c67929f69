"""A cluster that exists only in memory, for `run --simulate PROFILE` on a laptop with no cluster.

It is a product feature, not a test fake: it serves one Node and its pods, keeps Leases and logs each Event it
is sent, so an operator can watch what the agent would decide for an injected fault and what network accounting
would count per pod. Patches are applied with the same merge rules the agent relies on, so the simulation also
works without `--dry-run`. Pod changes (`add_pod`, `delete_pod`, evictions) reach pod watches as the API
server's would, with versions from one counter shared with the Node.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

from agent.kube.errors import ApiConflict, ApiGone, ApiNotFound
from agent.kube.model import (
    Condition,
    EventRecord,
    LeaseView,
    NodeView,
    PodList,
    PodView,
    Taint,
    WatchEvent,
    apply_patch,
    with_condition,
    without_condition,
)

log = logging.getLogger(__name__)

POD_LOG_LIMIT = 1000  # pod changes kept for watches; a watch from before them gets 410, as after etcd compaction


class InMemoryCluster:
    """`port.Cluster` over one in-memory Node and its pods."""

    def __init__(self, node_name: str, *, pods: Iterable[PodView] = (), taints: Iterable[Any] = ()) -> None:
        self.node_name = node_name
        self._versions = itertools.count(1)
        self.node = NodeView(node_name, self._next(), taints=tuple(taints))
        self.pods = {p.key: dataclasses.replace(p, resource_version=self._next()) for p in pods}
        self.leases: dict[tuple[str, str], LeaseView] = {}
        self.resource_slices: dict[str, dict[str, Any]] = {}
        self.resource_claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: list[EventRecord] = []
        self.node_features: dict[tuple[str, str], dict[str, Any]] = {}  # NFD NodeFeatures, served in memory
        self._changed = asyncio.Condition()
        self._pod_log: list[tuple[int, str, PodView]] = []
        self._pods_changed = asyncio.Event()
        self._oldest = 0

    def _next(self) -> str:
        self.version = next(self._versions)
        return str(self.version)

    async def _bump(self, node: NodeView) -> NodeView:
        self.node = dataclasses.replace(node, resource_version=self._next())
        async with self._changed:
            self._changed.notify_all()
        return self.node

    async def get_node(self) -> NodeView:
        """The node."""
        return self.node

    async def review_access(self, verb: str, resource: str, *, group: str = "", subresource: str = "",
                            namespace: str = "") -> tuple[bool, str]:
        """The in-memory cluster lets the agent do everything."""
        return True, "in-memory cluster"

    async def watch_node(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[NodeView]]:
        """MODIFIED for every change after `resource_version`, until `timeout_seconds` pass quietly."""
        seen = resource_version
        while True:
            if self.node.resource_version != seen:
                seen = self.node.resource_version
                yield WatchEvent("MODIFIED", seen, self.node)
                continue
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), timeout_seconds)
            if self.node.resource_version == seen:
                return

    async def patch_node(self, patch: dict[str, Any], resource_version: str | None = None) -> NodeView:
        """Merge patch with the resourceVersion precondition."""
        if resource_version and resource_version != self.node.resource_version:
            raise ApiConflict(409, "the object has been modified")
        return await self._bump(apply_patch(self.node, patch))

    async def patch_node_condition(self, condition: Condition,
                                   annotations: Mapping[str, str | None] | None = None) -> NodeView:
        """Replace one condition by type, and set the annotations given in the same write."""
        node = apply_patch(self.node, {"metadata": {"annotations": dict(annotations)}}) if annotations else self.node
        return await self._bump(with_condition(node, condition))

    async def remove_node_condition(self, condition_type: str) -> NodeView:
        """Remove one condition by type."""
        return await self._bump(without_condition(self.node, condition_type))

    # --- pods ---------------------------------------------------------------------------------------------------

    def add_pod(self, pod: PodView) -> PodView:
        """Create or replace a pod on the node (ADDED or MODIFIED for watches)."""
        kind = "MODIFIED" if pod.key in self.pods else "ADDED"
        stored = dataclasses.replace(pod, resource_version=self._next())
        self.pods[pod.key] = stored
        self._log_pod(kind, stored)
        return stored

    def delete_pod(self, namespace: str, name: str) -> PodView:
        """Remove a pod (DELETED for watches); ApiNotFound when there is none."""
        pod = self.pods.pop((namespace, name), None)
        if pod is None:
            raise ApiNotFound(404, f"pods {name!r} not found")
        self._log_pod("DELETED", dataclasses.replace(pod, resource_version=self._next()))
        return pod

    def _log_pod(self, kind: str, pod: PodView) -> None:
        self._pod_log.append((self.version, kind, pod))
        if len(self._pod_log) > POD_LOG_LIMIT:
            self._oldest = self._pod_log.pop(0)[0]
        self._pods_changed.set()
        self._pods_changed = asyncio.Event()

    async def list_pods(self) -> list[PodView]:
        """Pods on the node."""
        return list(self.pods.values())

    async def list_node_pods(self) -> PodList:
        """Pods on the node and the current version."""
        return PodList(tuple(self.pods.values()), str(self.version))

    async def find_node_pod(self, namespace: str, name: str) -> PodView | None:
        """The pod, when it is on the node."""
        return self.pods.get((namespace, name))

    async def watch_pods(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[PodView]]:
        """Every pod change after `resource_version`, then a BOOKMARK when `timeout_seconds` have passed."""
        seen = int(resource_version or self.version)
        if seen < self._oldest:
            raise ApiGone(410, "too old resource version")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while True:
            changed = self._pods_changed
            for version, kind, pod in list(self._pod_log):
                if version > seen:
                    seen = version
                    yield WatchEvent(kind, str(version), pod)
            remaining = deadline - loop.time()
            if remaining <= 0:
                yield WatchEvent("BOOKMARK", str(self.version))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)

    async def evict_pod(self, namespace: str, name: str) -> None:
        """Remove the pod at once."""
        self.delete_pod(namespace, name)
        log.info("simulated cluster: evicted pod %s/%s", namespace, name)

    # --- events and leases --------------------------------------------------------------------------------------

    async def write_event(self, event: EventRecord) -> EventRecord:
        """Keep and log the Event."""
        if not event.name:
            event = dataclasses.replace(event, name=f"{self.node_name}.{len(self.events) + 1}")
        self.events.append(event)
        log.debug("simulated cluster: Event %s %s x%d on node %s: %s", event.type, event.reason, event.count,
                  self.node_name, event.message)
        return event

    async def list_leases(self, namespace: str, labels: dict[str, str]) -> list[LeaseView]:
        """Leases in the namespace with all these labels."""
        return [le for (ns, _), le in self.leases.items()
                if ns == namespace and all(le.labels.get(k) == v for k, v in labels.items())]

    async def write_lease(self, namespace: str, lease: LeaseView) -> LeaseView:
        """Create or replace with resourceVersion precondition."""
        key = (namespace, lease.name)
        current = self.leases.get(key)
        if (current is None) != (not lease.resource_version) or (
                current is not None and current.resource_version != lease.resource_version):
            raise ApiConflict(409, f"lease {lease.name} changed")
        written = dataclasses.replace(lease, resource_version=self._next())
        self.leases[key] = written
        return written

    # --- DRA: ResourceSlices and ResourceClaims ----------------------------------------------------------------

    async def node_uid(self) -> str:
        """The kubelet's convention: the node's name as its uid."""
        return self.node_name

    async def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        """This node's slices of `driver`."""
        return [copy.deepcopy(s) for s in self.resource_slices.values()
                if s["spec"].get("driver") == driver and s["spec"].get("nodeName") == self.node_name]

    async def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Store a new slice (409 when the name is taken)."""
        name = body["metadata"]["name"]
        if name in self.resource_slices:
            raise ApiConflict(409, f'resourceslices "{name}" already exists')
        return self._store_slice(body)

    async def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """Replace a slice with the resourceVersion precondition."""
        name = body["metadata"]["name"]
        current = self.resource_slices.get(name)
        if current is None:
            raise ApiNotFound(404, f'resourceslices "{name}" not found')
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiConflict(409, "the object has been modified")
        return self._store_slice(body)

    def _store_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = self._next()
        self.resource_slices[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    async def delete_resource_slice(self, name: str) -> None:
        """Remove a slice."""
        if self.resource_slices.pop(name, None) is None:
            raise ApiNotFound(404, f'resourceslices "{name}" not found')

    # --- NFD NodeFeatures (node labels) ---------------------------------------------------------------------------

    async def node_features_served(self) -> bool:
        """The in-memory cluster serves NodeFeatures (the demo shows the object the agent would publish)."""
        return True

    async def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A stored NodeFeature."""
        found = self.node_features.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    async def create_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Store a new NodeFeature (409 when the name is taken)."""
        key = (namespace, body["metadata"]["name"])
        if key in self.node_features:
            raise ApiConflict(409, f'nodefeatures "{key[1]}" already exists')
        return self._store_feature(key, body)

    async def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Replace a NodeFeature with the resourceVersion precondition."""
        key = (namespace, body["metadata"]["name"])
        current = self.node_features.get(key)
        if current is None:
            raise ApiNotFound(404, f'nodefeatures "{key[1]}" not found')
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiConflict(409, "the object has been modified")
        return self._store_feature(key, body)

    def _store_feature(self, key: tuple[str, str], body: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = self._next()
        stored["metadata"]["namespace"] = key[0]
        self.node_features[key] = stored
        log.info("simulated cluster: NodeFeature %s/%s has %d labels", key[0], key[1],
                 len((stored.get("spec") or {}).get("labels") or {}))
        return copy.deepcopy(stored)

    def add_resource_claim(self, claim: dict[str, Any]) -> None:
        """Create or replace a claim (what the scheduler's allocation writes)."""
        meta = claim["metadata"]
        self.resource_claims[(meta.get("namespace", "default"), meta["name"])] = copy.deepcopy(claim)

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A stored claim."""
        claim = self.resource_claims.get((namespace, name))
        if claim is None:
            raise ApiNotFound(404, f'resourceclaims "{name}" not found')
        return copy.deepcopy(claim)

    async def aclose(self) -> None:
        """Nothing to release."""


def demo_cluster(node_name: str = "", preflight_taint: str = "") -> InMemoryCluster:
    """The `--simulate` node (with the preflight taint when given): a training pod with an IPv4 and an IPv6
    address, and a host-network DaemonSet pod (not accounted per pod, never evicted)."""
    taints = [Taint(preflight_taint, "NoSchedule")] if preflight_taint else []
    pods = [PodView("default", "training-job-0", ("Job",), ips=("10.244.0.10", "fd00:10:244::a")),
            PodView("kube-system", "nvidia-device-plugin-x1", ("DaemonSet",), ips=("192.168.0.10",),
                    host_network=True)]
    return InMemoryCluster(node_name or "simulated-node", pods=pods, taints=taints)
