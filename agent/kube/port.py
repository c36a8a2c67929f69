"""The cluster port: the only API-server operations the agent may perform, as small Protocols.

Each consumer names the narrow protocol it needs (drain gets `PodApi`, slots get `LeaseApi`, network accounting
gets `PodWatchApi`), which documents and limits what it can do. The whole list is what the RBAC rules grant
(deploy/rbac.yaml): the own Node (get, watch by name, patch, patch status), pods on the own node (list and
watch with `spec.nodeName`; one pod by name is a namespaced LIST with `metadata.name` and `spec.nodeName`, since
RBAC cannot bound a GET to the own node), evictions, Events, Leases in one namespace, and for the DRA driver its own
ResourceSlices (by `spec.nodeName` and `spec.driver`; a ValidatingAdmissionPolicy binds writes to the node) and
ResourceClaims by name, and for node labels NFD NodeFeatures in the agent's namespace (read only in GPU Feature
Discovery's). Nothing the agent runs lists or watches cluster-wide; only the operator's read-only
`gpu-node-agent fleet` command pages through every Node (`NodeListApi`), with the operator's own credentials.
Every method raises only `agent.kube.errors.Api*` errors. DRA objects cross the port as their JSON (dicts): the
driver owns their meaning.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

from agent.kube.model import Condition, EventRecord, LeaseView, NodeView, PodList, PodView, WatchEvent
from agent.kube.nodelist import NodePage


class NodeApi(Protocol):
    """The agent's own Node object."""

    node_name: str

    async def get_node(self) -> NodeView:
        """GET the node."""

    def watch_node(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[NodeView]]:
        """One watch request on this node by name, with bookmarks; ends when the server closes it (410: ApiGone)."""

    async def patch_node(self, patch: dict[str, Any], resource_version: str | None = None) -> NodeView:
        """JSON merge patch of the node; with `resource_version` the server refuses (409) if the node changed."""

    async def patch_node_condition(self, condition: Condition,
                                   annotations: Mapping[str, str | None] | None = None) -> NodeView:
        """Strategic-merge patch of one condition on nodes/status (merged by type, others untouched); with
        `annotations`, those ride in the same request (nodes/status resets only `spec`, so metadata is kept; None
        removes a key)."""

    async def remove_node_condition(self, condition_type: str) -> NodeView:
        """Strategic-merge `$patch: delete` of the condition of this type on nodes/status (others untouched)."""


class PodApi(Protocol):
    """Pods bound to the agent's node, for drain."""

    async def list_pods(self) -> list[PodView]:
        """LIST pods with fieldSelector spec.nodeName=<node> (served from the watch-cache index)."""

    async def evict_pod(self, namespace: str, name: str) -> None:
        """POST a policy/v1 Eviction for the pod."""


class PodWatchApi(Protocol):
    """Pods bound to the agent's node, kept current by list + watch (`agent.kube.podwatch`)."""

    node_name: str

    async def list_node_pods(self) -> PodList:
        """LIST pods with fieldSelector spec.nodeName=<node>, with the list's resourceVersion."""

    def watch_pods(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[PodView]]:
        """One watch request with fieldSelector spec.nodeName=<node> and bookmarks from `resource_version`; ends
        when the server closes it after `timeout_seconds` (410: ApiGone, the version is too old)."""


class PodLookupApi(Protocol):
    """One pod of this node by name, for a pod the own-node watch has not delivered yet (device ownership)."""

    async def find_node_pod(self, namespace: str, name: str) -> PodView | None:
        """LIST pods in `namespace` with fieldSelector metadata.name=<name>,spec.nodeName=<node>: the pod, or None
        when no such pod is on this node (gone, or never here). Needs only `list pods`, and cannot read a pod of
        another node."""


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


class ResourceSliceApi(Protocol):
    """resource.k8s.io/v1 ResourceSlices of one driver on this node (the DRA driver's pool)."""

    node_name: str

    async def node_uid(self) -> str:
        """The own Node's metadata.uid (slices are owned by the Node, so they go with it)."""

    async def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        """LIST with fieldSelector spec.nodeName=<node>,spec.driver=<driver>."""

    async def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a slice (409 ApiConflict when the name exists)."""

    async def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a slice guarded by its metadata.resourceVersion (409 ApiConflict when it changed)."""

    async def delete_resource_slice(self, name: str) -> None:
        """DELETE a slice (ApiNotFound when it is gone)."""


class ResourceClaimApi(Protocol):
    """resource.k8s.io/v1 ResourceClaims, read by name when the kubelet asks to prepare them."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """GET the claim (ApiNotFound when it is gone)."""


class NodeFeatureApi(Protocol):
    """NFD's `nfd.k8s-sigs.io/v1alpha1` NodeFeatures in named namespaces (node labels): the agent's own object in
    its namespace, and reads of GPU Feature Discovery's. Bodies cross the port as JSON (dicts)."""

    node_name: str

    async def node_features_served(self) -> bool:
        """Whether the API server serves the NodeFeature resource (API discovery of the group version)."""

    async def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """GET one NodeFeature; None when there is none."""

    async def create_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a NodeFeature (409 ApiConflict when the name is taken)."""

    async def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a NodeFeature guarded by its metadata.resourceVersion (409 ApiConflict when it changed)."""


class AccessApi(Protocol):
    """What RBAC lets the agent's own identity do (SelfSubjectAccessReview; `gpu-node-agent doctor`)."""

    async def review_access(self, verb: str, resource: str, *, group: str = "", subresource: str = "",
                            namespace: str = "") -> tuple[bool, str]:
        """Whether the verb on the resource is allowed, and the authorizer's reason (often empty)."""


class NodeListApi(Protocol):
    """Every Node of the cluster, one LIST page at a time, read-only (`gpu-node-agent fleet`)."""

    async def list_nodes_page(self, label_selector: str, limit: int, continue_token: str) -> NodePage:
        """LIST nodes with `limit`, `labelSelector` when non-empty and `continue` when non-empty (never a
        resourceVersion); the page may hold fewer than `limit` nodes, even none, and still have a continue token."""

    async def aclose(self) -> None:
        """Release connections."""


class Cluster(NodeApi, PodApi, PodWatchApi, PodLookupApi, EventApi, LeaseApi, ResourceSliceApi, ResourceClaimApi,
              NodeFeatureApi, AccessApi, Protocol):
    """Everything the agent does on the API server; one client shared by remediation and network accounting."""

    async def aclose(self) -> None:
        """Release connections."""
