"""The real cluster port on lightkube's async client; the only module of the agent that imports lightkube.

Two boundary duties live here. Every HTTP exchange passes through `transport.CountingTransport`, which feeds
`gpu_node_agent_apiserver_requests_total{verb,code}`: at 7,500 nodes the fleet's load is this counter times the
node count. Every failure (lightkube `ApiError`, httpx status errors, timeouts, connection errors, undecodable
bodies) leaves as an `agent.kube.errors.Api*` exception with `raise ... from`.

Watches (the own Node by name, the node's pods by `spec.nodeName`) are one request per call, asking for
bookmarks: lightkube's public `watch()` cannot request `allowWatchBookmarks` and reconnects on its own, which
would hide requests from the caller's backoff. They use lightkube's request builder (`_client.prepare_request`),
hence the pinned lightkube minor version. One `LightkubeCluster` serves every subsystem of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, TypeVar, cast

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.core.exceptions import ApiError as LightkubeApiError
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice
from lightkube.types import PatchType
from prometheus_client import CollectorRegistry

from agent.kube import errors
from agent.kube.errors import ClusterConfigError
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import (
    Condition,
    EventRecord,
    LeaseView,
    NodeView,
    PodList,
    PodView,
    WatchEvent,
    format_time,
)
from agent.kube.names import check_node_name, url_segment
from agent.kube.nodelist import MAX_PAGE_BYTES, NodePage, decode_node_page
from agent.kube.podlist import DecodedPods, decode_node_pods, read_bounded, status_message
from agent.kube.transport import CountingTransport

log = logging.getLogger(__name__)

FIELD_MANAGER = "gpu-node-agent"
COMPONENT = "gpu-node-agent"
ALL_NAMESPACES = "*"
T = TypeVar("T")
NFD_GROUP, NFD_VERSION = "nfd.k8s-sigs.io", "v1alpha1"
NodeFeature = create_namespaced_resource(NFD_GROUP, NFD_VERSION, "NodeFeature", "nodefeatures")


def _retry_after(response: httpx2.Response | None) -> float | None:
    if response is None:
        return None
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


def translate(exc: BaseException) -> errors.ApiError:
    """Our exception for any client-side failure."""
    if isinstance(exc, LightkubeApiError):
        response = exc.response if isinstance(getattr(exc, "response", None), httpx2.Response) else None
        code = response.status_code if response is not None else int(exc.status.code or 500)
        return errors.error_for_status(code, exc.status.message or "", _retry_after(response))
    if isinstance(exc, httpx2.HTTPStatusError):
        return errors.error_for_status(exc.response.status_code, exc.response.reason_phrase,
                                       _retry_after(exc.response))
    if isinstance(exc, httpx2.TimeoutException):
        return errors.ApiTimeout(f"timed out: {type(exc).__name__}")
    if isinstance(exc, httpx2.HTTPError):
        return errors.ApiUnavailable(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, LightkubeConfigError):  # e.g. the projected token file is briefly missing
        return errors.ApiUnavailable(f"credentials: {exc}")
    if isinstance(exc, (msgspec.DecodeError, json.JSONDecodeError)):
        return errors.ApiServerError(502, f"undecodable response: {exc}")
    raise TypeError(f"not an API failure: {exc!r}")  # a bug here, not an API error


_FAILURES = (httpx2.HTTPError, msgspec.DecodeError, json.JSONDecodeError, LightkubeConfigError)


class LightkubeCluster:
    """`port.Cluster` on a lightkube `AsyncClient` whose transport counts requests."""

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
        self._warned: set[str] = set()  # requests whose foreign pods were logged as a warning

    async def _do(self, call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except _FAILURES as exc:
            raise translate(exc) from exc
        except ValueError as exc:  # url_segment refused a name before any request was sent
            raise errors.ApiError(400, f"refused before sending: {exc}") from exc

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

    async def watch_pods(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[PodView]]:
        """One watch of this node's pods (fieldSelector spec.nodeName, all namespaces) with bookmarks; events of
        other nodes' pods (a server ignoring the selector) are skipped and counted."""
        def own_pod(obj: Mapping[str, Any]) -> PodView | None:
            return PodView.from_dict(obj) if (obj.get("spec") or {}).get("nodeName") == self.node_name else None

        events = self._watch(Pod, ALL_NAMESPACES, f"spec.nodeName={self.node_name}", resource_version,
                             timeout_seconds=timeout_seconds, parse=own_pod)
        async with contextlib.aclosing(events):  # the response closes with this watch, not at garbage collection
            async for event in events:
                if event.type != "BOOKMARK" and event.object is None:
                    self._skipped("watch_pods", 1)
                    continue
                yield cast(WatchEvent[PodView], event)

    async def _watch(self, res: type[Any], namespace: str | None, selector: str, resource_version: str, *,
                     timeout_seconds: int, parse: Callable[[Mapping[str, Any]], T]) -> AsyncGenerator[WatchEvent[T]]:
        generic = self._client._client
        br = generic.prepare_request("list", res=res, namespace=namespace, watch=True, params={
            "fieldSelector": selector, "resourceVersion": resource_version or None,
            "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)})
        br.timeout = httpx2.Timeout(self._timeout, read=timeout_seconds + 30.0)
        try:
            response = await generic.send(generic.build_adapter_request(br), stream=True)
        except _FAILURES as exc:
            raise translate(exc) from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                raise errors.error_for_status(response.status_code, response.text[:200], _retry_after(response))
            async for line in response.aiter_lines():
                if line.strip():
                    yield _watch_event(line, parse)
        except _FAILURES as exc:
            raise translate(exc) from exc
        finally:
            await response.aclose()

    async def list_pods(self) -> list[PodView]:
        """Pods on this node only (fieldSelector spec.nodeName), all namespaces."""
        return list((await self.list_node_pods()).pods)

    async def list_node_pods(self) -> PodList:
        """Pods on this node only, with the list's resourceVersion (where a watch continues)."""
        decoded = await self._list_node_pods(ALL_NAMESPACES, f"spec.nodeName={self.node_name}", "list_node_pods")
        if not decoded.resource_version:
            raise errors.ApiServerError(502, "pod list without a resourceVersion")
        return PodList(decoded.pods, decoded.resource_version)

    async def find_node_pod(self, namespace: str, name: str) -> PodView | None:
        """One pod by name, only if it is on this node: a LIST in its namespace with both field selectors (a consistent
        read, no resourceVersion: the watch cache may lag as the watch does). Pods of other nodes or with other names
        in the answer (a server ignoring the field selector) are skipped; two pods by the name are not believed."""
        try:
            path_ns, path_name = url_segment(namespace, namespace=True), url_segment(name)
        except ValueError as exc:  # refused before any request is sent
            raise errors.ApiError(400, f"refused before sending: {exc}") from exc
        decoded = await self._list_node_pods(path_ns, f"metadata.name={path_name},spec.nodeName={self.node_name}",
                                             "find_node_pod")
        pods = [p for p in decoded.pods if p.key == (namespace, name)]
        if len(pods) > 1:
            raise errors.ApiServerError(502, f"a list of pod {namespace}/{name} returned it {len(pods)} times")
        return pods[0] if pods else None

    async def _list_node_pods(self, namespace: str, selector: str, request: str) -> DecodedPods:
        """One pod LIST, read with a size bound and decoded in a worker thread (`agent.kube.podlist`): a proxy that
        drops the selector answers with the whole cluster, which must neither hold the loop nor be believed."""
        generic = self._client._client
        br = generic.prepare_request("list", res=Pod, namespace=namespace, params={"fieldSelector": selector})
        try:
            response = await generic.send(generic.build_adapter_request(br), stream=True)
        except _FAILURES as exc:
            raise translate(exc) from exc
        try:
            if response.status_code >= 400:
                await response.aread()
                raise errors.error_for_status(response.status_code, status_message(response.content),
                                              _retry_after(response))
            body = await read_bounded(response.aiter_bytes())
        except _FAILURES as exc:
            raise translate(exc) from exc
        finally:
            await response.aclose()
        decoded = await asyncio.to_thread(decode_node_pods, body, self.node_name)
        if decoded.foreign:
            self._skipped(request, decoded.foreign)
        return decoded

    def _skipped(self, request: str, pods: int) -> None:
        """Count pods of other nodes in an answer; warn once per request kind (a proxy that ignores selectors does
        so on every request), then at debug level."""
        self._foreign.labels(request).inc(pods)
        level = logging.DEBUG if request in self._warned else logging.WARNING
        self._warned.add(request)
        log.log(level, "the API server answered %s with %d pods of other nodes: it ignores the field selector; they "
                "were skipped (gpu_node_agent_apiserver_foreign_pods_total)", request, pods)

    async def evict_pod(self, namespace: str, name: str) -> None:
        """policy/v1 Eviction (lightkube fills apiVersion and kind)."""
        async def call() -> None:
            path_name, path_ns = url_segment(name), url_segment(namespace, namespace=True)
            eviction = Pod.Eviction(metadata=ObjectMeta(name=name, namespace=namespace))
            await self._client.create(eviction, name=path_name, namespace=path_ns)
        await self._do(call)

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

    async def node_features_served(self) -> bool:
        """GET the group version's discovery document (readable by every authenticated identity) and look for
        `nodefeatures`; 404 means NFD's CRD is not installed."""
        async def call() -> bool:
            response = await self._client._client._client.get(f"/apis/{NFD_GROUP}/{NFD_VERSION}")
            if response.status_code == 404:
                return False
            response.raise_for_status()
            resources = (response.json() or {}).get("resources") or []
            return any(isinstance(r, dict) and r.get("name") == "nodefeatures" for r in resources)
        return await self._do(call)

    async def get_node_feature(self, namespace: str, name: str) -> dict[str, Any] | None:
        """GET a NodeFeature; None for 404."""
        try:
            found = await self._do(lambda: self._client.get(NodeFeature, url_segment(name),
                                                            namespace=url_segment(namespace, namespace=True)))
        except errors.ApiNotFound:
            return None
        return dict(found.to_dict())

    async def create_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a NodeFeature."""
        path_ns = url_segment(namespace, namespace=True)
        created = await self._do(lambda: self._client.create(NodeFeature.from_dict(body), namespace=path_ns))  # type: ignore[call-overload]
        return dict(created.to_dict())

    async def replace_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT a NodeFeature (its resourceVersion is the precondition)."""
        name = str((body.get("metadata") or {}).get("name") or "")
        path_ns = url_segment(namespace, namespace=True)
        written = await self._do(lambda: self._client.replace(NodeFeature.from_dict(body), url_segment(name),
                                                              namespace=path_ns))
        return dict(written.to_dict())

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


def _watch_event(line: str, parse: Callable[[Mapping[str, Any]], T]) -> WatchEvent[T]:
    try:
        event = json.loads(line)
        kind, obj = event["type"], event.get("object") or {}
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.ApiServerError(502, f"undecodable watch line: {line[:120]!r}") from exc
    if kind == "ERROR":
        raise errors.error_for_status(int(obj.get("code") or 500), obj.get("message") or "")
    version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    if kind == "BOOKMARK":
        return WatchEvent("BOOKMARK", version)
    return WatchEvent(kind, version, parse(obj))


def _async_client(counter: ApiRequestCounter, kubeconfig: str | None, timeout: float) -> AsyncClient:
    """A lightkube client from a kubeconfig file, or the in-cluster service account when none is given."""
    try:
        config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_service_account()
        single = config.get()
    except (LightkubeConfigError, KeyError, OSError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        raise ClusterConfigError(f"cannot use {where} ({exc}); set --kubeconfig or run in a pod with a "
                                 f"service account") from exc
    if single is None or single.user is None:
        raise ClusterConfigError(f"kubeconfig {kubeconfig} has no current context with a user")
    verify = verify_cluster(single.cluster, single.user, single.abs_file)
    transport = CountingTransport(httpx2.AsyncHTTPTransport(verify=verify), counter)
    return AsyncClient(single, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER, transport=transport)


def connect(node_name: str, counter: ApiRequestCounter, kubeconfig: str | None = None, timeout: float = 10.0,
            event_namespace: str = "default") -> LightkubeCluster:
    """A `LightkubeCluster` from a kubeconfig file, or the in-cluster service account when none is given."""
    client = _async_client(counter, kubeconfig, timeout)
    return LightkubeCluster(client, node_name, event_namespace, timeout, counter)


class LightkubeNodes:
    """`port.NodeListApi`: pages of the cluster-wide Node LIST, read-only (`gpu-node-agent fleet`)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list_nodes_page(self, label_selector: str, limit: int, continue_token: str) -> NodePage:
        """One LIST page; never a resourceVersion (with `continue` the server refuses one: 400)."""
        params = {"limit": str(limit), "labelSelector": label_selector or None, "continue": continue_token or None}
        generic = self._client._client
        br = generic.prepare_request("list", res=Node, params=params)
        try:
            response = await generic.send(generic.build_adapter_request(br), stream=True)
            try:
                if response.status_code >= 400:
                    await response.aread()
                    raise errors.error_for_status(response.status_code, status_message(response.content),
                                                  _retry_after(response))
                body = await read_bounded(response.aiter_bytes(), MAX_PAGE_BYTES, "node list page")
            finally:
                await response.aclose()
        except _FAILURES as exc:
            raise translate(exc) from exc
        return await asyncio.to_thread(decode_node_page, body)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.close()


def connect_nodes(counter: ApiRequestCounter, kubeconfig: str | None = None, timeout: float = 10.0) -> LightkubeNodes:
    """A `LightkubeNodes` from a kubeconfig file, or the in-cluster service account."""
    return LightkubeNodes(_async_client(counter, kubeconfig, timeout))
