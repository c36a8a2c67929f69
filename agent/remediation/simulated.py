"""A cluster that exists only in memory, for `run --simulate PROFILE --dry-run` on a laptop with no cluster.

It is a product feature, not a test fake: it serves one Node (plus optional pods), keeps Leases and logs each
Event it is sent, so an operator can watch what the agent would decide for an injected fault. Patches are
applied with the same merge rules the agent relies on, so the simulation also works without `--dry-run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from agent.remediation.model import (
    ApiConflict,
    ApiNotFound,
    Condition,
    EventRecord,
    LeaseView,
    NodeView,
    PodView,
    WatchEvent,
)
from agent.remediation.state import apply_patch, with_condition

log = logging.getLogger(__name__)


class InMemoryCluster:
    """`port.Cluster` over one in-memory Node."""

    def __init__(self, node_name: str, *, pods: Iterable[PodView] = (), taints: Iterable[Any] = ()) -> None:
        self.node_name = node_name
        self._versions = itertools.count(1)
        self.node = NodeView(node_name, str(next(self._versions)), taints=tuple(taints))
        self.pods = {(p.namespace, p.name): p for p in pods}
        self.leases: dict[tuple[str, str], LeaseView] = {}
        self.events: list[EventRecord] = []
        self._changed = asyncio.Condition()

    async def _bump(self, node: NodeView) -> NodeView:
        self.node = dataclasses.replace(node, resource_version=str(next(self._versions)))
        async with self._changed:
            self._changed.notify_all()
        return self.node

    async def get_node(self) -> NodeView:
        """The node."""
        return self.node

    async def watch_node(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent]:
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

    async def patch_node_condition(self, condition: Condition) -> NodeView:
        """Replace one condition by type."""
        return await self._bump(with_condition(self.node, condition))

    async def list_pods(self) -> list[PodView]:
        """Pods on the node."""
        return list(self.pods.values())

    async def evict_pod(self, namespace: str, name: str) -> None:
        """Remove the pod at once."""
        if self.pods.pop((namespace, name), None) is None:
            raise ApiNotFound(404, f"pods {name!r} not found")
        log.info("simulated cluster: evicted pod %s/%s", namespace, name)

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
        written = dataclasses.replace(lease, resource_version=str(next(self._versions)))
        self.leases[key] = written
        return written

    async def aclose(self) -> None:
        """Nothing to release."""
