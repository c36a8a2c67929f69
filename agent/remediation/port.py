"""The cluster port: the only API-server operations remediation may perform, as four small Protocols.

Each consumer names the narrow protocol it needs (drain gets `PodApi`, slots get `LeaseApi`), which documents
and limits what it can do. The whole list is what the RBAC rules grant: the own Node (get, watch by name,
patch, patch status), pods on the own node (list with `spec.nodeName`), evictions, Events, and Leases in one
namespace. Nothing lists or watches cluster-wide. Every method raises only `model.Api*` errors.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from agent.remediation.model import Condition, EventRecord, LeaseView, NodeView, PodView, WatchEvent


class NodeApi(Protocol):
    """The agent's own Node object."""

    node_name: str

    async def get_node(self) -> NodeView:
        """GET the node."""

    def watch_node(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent]:
        """One watch request on this node by name, with bookmarks; ends when the server closes it (410: ApiGone)."""

    async def patch_node(self, patch: dict[str, Any], resource_version: str | None = None) -> NodeView:
        """JSON merge patch of the node; with `resource_version` the server refuses (409) if the node changed."""

    async def patch_node_condition(self, condition: Condition) -> NodeView:
        """Strategic-merge patch of one condition on nodes/status (merged by type, others untouched)."""


class PodApi(Protocol):
    """Pods bound to the agent's node."""

    async def list_pods(self) -> list[PodView]:
        """LIST pods with fieldSelector spec.nodeName=<node> (served from the watch-cache index)."""

    async def evict_pod(self, namespace: str, name: str) -> None:
        """POST a policy/v1 Eviction for the pod."""


class EventApi(Protocol):
    """core/v1 Events about the node."""

    async def write_event(self, event: EventRecord) -> EventRecord:
        """Create the Event, or (when it has a name) patch its count and lastTimestamp; returns it with its name."""


class LeaseApi(Protocol):
    """coordination.k8s.io Leases in one namespace (the remediation slots)."""

    async def list_leases(self, namespace: str, labels: dict[str, str]) -> list[LeaseView]:
        """LIST Leases in `namespace` matching `labels`."""

    async def write_lease(self, namespace: str, lease: LeaseView) -> LeaseView:
        """Create the Lease, or replace it when it carries a resourceVersion (409 if someone else wrote it)."""


class Cluster(NodeApi, PodApi, EventApi, LeaseApi, Protocol):
    """Everything remediation does on the API server."""

    async def aclose(self) -> None:
        """Release connections."""
