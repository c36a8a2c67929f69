"""The real cluster port on lightkube's async client: `LightkubeCluster` and `connect`. lightkube is imported only
by this module and the modules of the real port beside it: `calls` (the client, error translation, streamed
requests), `pod_calls` and `nodefeature_calls` (request groups that are bases of `LightkubeCluster`) and `nodes`
(the fleet view's Node LIST).

Two boundary duties hold for all of them. Every HTTP exchange passes through `transport.CountingTransport`, which
feeds `gpu_node_agent_apiserver_requests_total{verb,code}`: at 7,500 nodes the fleet's load is this counter times
the node count. Every failure leaves as an `agent.kube.errors.Api*` exception with `raise ... from`
(`calls.translate`). Watches (the own Node by name, the node's pods by `spec.nodeName`) are one request per call,
asking for bookmarks (`calls.Calls._watch`). One `LightkubeCluster` serves every subsystem of the process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from lightkube import AsyncClient
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType
from prometheus_client import CollectorRegistry

from agent.kube import errors
from agent.kube.calls import FIELD_MANAGER, async_client
from agent.kube.errors import ClusterConfigError
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import Condition, EventRecord, LeaseView, NodeView, WatchEvent, format_time
from agent.kube.names import check_node_name, url_segment
from agent.kube.nodefeature_calls import NodeFeatureCalls
from agent.kube.pod_calls import PodCalls

__all__ = ["FIELD_MANAGER", "LightkubeCluster", "connect"]  # FIELD_MANAGER: as written to the API

COMPONENT = "gpu-node-agent"


class LightkubeCluster(PodCalls, NodeFeatureCalls):
    """`port.Cluster` on a lightkube `AsyncClient` whose transport counts requests; the pod requests and the
    NodeFeature requests come from its bases."""

    def __init__(self, client: AsyncClient, node_name: str, event_namespace: str = "default",
                 timeout: float = 10.0, counter: ApiRequestCounter | None = None) -> None:
        try:
            self._node = url_segment(check_node_name(node_name))  # the node's name as it goes into paths
            self._event_ns = url_segment(event_namespace, namespace=True)
        except ValueError as exc:
            raise ClusterConfigError(str(exc)) from exc
        self._client = client
        self._timeout = timeout
        self.node_name = node_name
        self._event_namespace = event_namespace
        self._foreign = (counter or ApiRequestCounter(CollectorRegistry())).foreign_pods
        self._warned = set()

    async def get_node(self) -> NodeView:
        """GET the node."""
        node = await self._do(lambda: self._client.get(Node, self._node))
        return NodeView.from_dict(node.to_dict())

    async def patch_node(self, patch: dict[str, Any], resource_version: str | None = None) -> NodeView:
        """Merge patch, optionally guarded by resourceVersion (409 ApiConflict when stale)."""
        body = dict(patch)
        if resource_version:
            body["metadata"] = {**(body.get("metadata") or {}), "resourceVersion": resource_version}
        node = await self._do(lambda: self._client.patch(Node, self._node, body, patch_type=PatchType.MERGE))
        return NodeView.from_dict(node.to_dict())

    async def patch_node_condition(self, condition: Condition,
                                   annotations: Mapping[str, str | None] | None = None) -> NodeView:
        """Strategic merge on nodes/status: conditions merge by type; annotations ride along (kept by nodes/status)."""
        body: dict[str, Any] = {"status": {"conditions": [condition.to_dict()]}}
        if annotations:
            body["metadata"] = {"annotations": dict(annotations)}
        node = await self._do(lambda: self._client.patch(Node.Status, self._node, body,
                                                         patch_type=PatchType.STRATEGIC))
        return NodeView.from_dict(node.to_dict())

    async def remove_node_condition(self, condition_type: str) -> NodeView:
        """Strategic merge on nodes/status: the `$patch: delete` directive removes the entry with this type."""
        body = {"status": {"conditions": [{"type": condition_type, "$patch": "delete"}]}}
        node = await self._do(lambda: self._client.patch(Node.Status, self._node, body,
                                                         patch_type=PatchType.STRATEGIC))
        return NodeView.from_dict(node.to_dict())

    def watch_node(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[NodeView]]:
        """One watch request by name with bookmarks; ERROR lines become exceptions (410: ApiGone)."""
        return self._watch(Node, None, f"metadata.name={self.node_name}", resource_version,
                           timeout_seconds=timeout_seconds, parse=self._own_node)

    def _own_node(self, obj: Mapping[str, Any]) -> NodeView:
        """A watched Node must be this one: a server (or proxy) that answers with another is not believed."""
        node = NodeView.from_dict(obj)
        if node.name != self.node_name:
            raise errors.ApiServerError(502, f"the watch of node {self.node_name} returned node {node.name[:80]!r}")
        return node

    async def write_event(self, event: EventRecord) -> EventRecord:
        """Create a core/v1 Event on the Node, or fold a repeat into it (count, lastTimestamp)."""
        last = format_time(event.last_time)

        def namespace() -> str:  # an Event lives in its object's namespace (a Pod's), the Node's in the configured one
            involved = event.involved
            return self._event_ns if involved is None else url_segment(involved.namespace, namespace=True)

        if event.name:
            body = {"count": event.count, "lastTimestamp": last, "message": event.message}
            await self._do(lambda: self._client.patch(Event, url_segment(event.name), body, namespace=namespace(),
                                                      patch_type=PatchType.MERGE))
            return event
        # lightkube's typed overloads omit `namespace` for namespaced resources; the implementation takes it
        created = await self._do(lambda: self._client.create(  # type: ignore[call-overload]
            cast(Event, Event.from_dict(self._event_body(event, namespace()))), namespace=namespace()))
        return dataclasses.replace(event, name=created.metadata.name)

    def _event_body(self, event: EventRecord, namespace: str) -> dict[str, Any]:
        involved = event.involved
        if involved is None:
            # kubelet names the Node's uid after the node, so `kubectl describe node` lists these Events
            about = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": self.node_name}
            prefix = self.node_name
        else:  # `kubectl describe pod` selects Events by the pod's kind, namespace, name and uid
            about = {"apiVersion": "v1", "kind": involved.kind, "namespace": involved.namespace,
                     "name": involved.name}
            if involved.uid:
                about["uid"] = involved.uid
            prefix = involved.name
        return {
            "metadata": {"generateName": f"{prefix}.", "namespace": namespace},
            "involvedObject": about,
            "reason": event.reason, "message": event.message, "type": event.type, "count": event.count,
            "firstTimestamp": format_time(event.first_time), "lastTimestamp": format_time(event.last_time),
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
        }

    async def list_leases(self, namespace: str, labels: dict[str, str]) -> list[LeaseView]:
        """Leases in one namespace with these labels."""
        async def call() -> list[LeaseView]:
            return [LeaseView.from_dict(item.to_dict()) async for item in
                    self._client.list(Lease, namespace=url_segment(namespace, namespace=True),
                                      labels=cast(dict[str, Any], labels))]
        return await self._do(call)

    async def write_lease(self, namespace: str, lease: LeaseView) -> LeaseView:
        """Create, or replace guarded by resourceVersion."""
        obj = cast(Lease, Lease.from_dict(lease.to_dict(namespace)))
        path_ns = url_segment(namespace, namespace=True)
        if lease.resource_version:
            written = await self._do(lambda: self._client.replace(obj, url_segment(lease.name), namespace=path_ns))
        else:
            written = await self._do(lambda: self._client.create(obj, namespace=path_ns))  # type: ignore[call-overload]
        return LeaseView.from_dict(written.to_dict())

    async def node_uid(self) -> str:
        """GET the node for its uid."""
        node = await self._do(lambda: self._client.get(Node, self._node))
        return str(node.metadata.uid or "")

    async def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        """This node's slices of one driver (field selectors, as the kubelet plugin helper lists them)."""
        async def call() -> list[dict[str, Any]]:
            listing = self._client.list(ResourceSlice, fields={"spec.nodeName": self.node_name, "spec.driver": driver})
            return [item.to_dict() async for item in listing]
        return await self._do(call)

    async def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST a ResourceSlice."""
        created = await self._do(lambda: self._client.create(ResourceSlice.from_dict(body)))
        return dict(created.to_dict())

    async def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a ResourceSlice (its resourceVersion is the precondition)."""
        name = str((body.get("metadata") or {}).get("name") or "")
        written = await self._do(lambda: self._client.replace(ResourceSlice.from_dict(body), url_segment(name)))
        return dict(written.to_dict())

    async def delete_resource_slice(self, name: str) -> None:
        """DELETE a ResourceSlice."""
        await self._do(lambda: self._client.delete(ResourceSlice, url_segment(name)))

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """GET a ResourceClaim."""
        claim = await self._do(lambda: self._client.get(ResourceClaim, url_segment(name),
                                                        namespace=url_segment(namespace, namespace=True)))
        return dict(claim.to_dict())

    async def review_access(self, verb: str, resource: str, *, group: str = "", subresource: str = "",
                            namespace: str = "") -> tuple[bool, str]:
        """POST a SelfSubjectAccessReview (every authenticated identity may: system:basic-user)."""
        attributes = ResourceAttributes(verb=verb, resource=resource, group=group, subresource=subresource or None,
                                        namespace=namespace or None)
        review = SelfSubjectAccessReview(spec=SelfSubjectAccessReviewSpec(resourceAttributes=attributes))
        answer = await self._do(lambda: self._client.create(review))
        status = answer.status
        return bool(status and status.allowed), str((status.reason if status else "") or "")

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.close()


def connect(node_name: str, counter: ApiRequestCounter, kubeconfig: str | None = None, timeout: float = 10.0,
            event_namespace: str = "default") -> LightkubeCluster:
    """A `LightkubeCluster` from a kubeconfig file, or the in-cluster service account when none is given."""
    client = async_client(counter, kubeconfig, timeout)
    return LightkubeCluster(client, node_name, event_namespace, timeout, counter)
