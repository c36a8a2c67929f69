"""A Kubernetes API double serving real HTTP/1.1 on 127.0.0.1, which lightkube talks to unmodified.

It implements just the endpoints the agent may use, with the semantics the agent relies on and that kmock does
not emulate: merge patch with the resourceVersion precondition (409), strategic merge of `status.conditions` by
type, field selectors as the API server parses them (comma-separated `=`, `==`, `!=` terms over the fields each
kind supports, 400 for any other field; pods: also listed per namespace), watches of the Node and of pods with
resourceVersion / bookmarks / timeoutSeconds / 410 after compaction, one resourceVersion counter for every
object (as etcd has), the Eviction subresource, Events with generateName, Leases with create-409 and
replace-409, resource.k8s.io/v1 ResourceSlices and ResourceClaims (`tests.fakes.apidra`), NFD NodeFeatures served
or not (`tests.fakes.apinfd`), and
SelfSubjectAccessReviews (201 with `status.allowed`; `denied` holds the (group, resource[/subresource], verb)
RBAC refuses, as an authorizer that says no without a reason). Everything
else answers 404 and is recorded, so tests can assert the agent made no other request.
Faults (status codes, delays for client timeouts) are scripted per method and path; `pod_watch_gate` makes pod
watches lag behind the store (lists stay current), `pod_lookup_gate` holds namespaced pod lists (a slow
answer to the agent's one-pod lookup). Watch timeouts follow the injected clock.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
from pathlib import Path
from typing import Any

import yaml

from tests.fakes.apidra import ResourceApi
from tests.fakes.apinfd import NodeFeatureApi
from tests.fakes.apistore import EventsAndLeases, merge_patch
from tests.fakes.clock import FakeClock
from tests.fakes.fieldselect import SelectorError, field_selector, field_value
from tests.fakes.httpdouble import Answer, HttpDouble, Request, status_body

__all__ = ["ApiServerDouble", "Request", "container_spec", "merge_patch", "write_kubeconfig"]


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig with a token user for the double at `url`."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "double",
        "clusters": [{"name": "double", "cluster": {"server": url}}],
        "users": [{"name": "agent", "user": {"token": "test-token"}}],
        "contexts": [{"name": "double", "context": {"cluster": "double", "user": "agent"}}]}))
    return path


def container_spec(name: str, limits: dict[str, int] | None = None, **extra: Any) -> dict[str, Any]:
    """One spec.containers entry with extended-resource limits (quantities as the API serialises them)."""
    return {"name": name, "image": "busybox", "resources": {"limits": {k: str(v) for k, v in (limits or {}).items()}},
            **extra}


class ApiServerDouble(EventsAndLeases, ResourceApi, NodeFeatureApi, HttpDouble):

    """One node, its pods (and pods of other nodes), Events and Leases, over HTTP."""

    def __init__(self, clock: FakeClock, node_name: str = "gpu-node-1") -> None:
        super().__init__(clock)
        self.node_name = node_name
        self._rv = itertools.count(100)
        self.rv = next(self._rv)
        self.node: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name, "uid": "uid-1", "resourceVersion": str(self.rv), "annotations": {},
                         "labels": {"kubernetes.io/hostname": node_name}},
            "spec": {"taints": []},
            "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (rv, event type, object) of nodes and pods
        self.oldest_rv = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.evictions: dict[tuple[str, str], list[int]] = {}
        self.resource_slices: dict[str, dict[str, Any]] = {}  # resource.k8s.io/v1 (tests.fakes.apidra)
        self.resource_claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.node_features: dict[tuple[str, str], dict[str, Any]] = {}  # NFD (tests.fakes.apinfd)
        self.nfd_served = True  # False: NFD's CRD is not installed
        self.open_watches = 0
        self.denied: set[tuple[str, str, str]] = set()  # (API group, resource[/subresource], verb) RBAC refuses
        # while set and not open, watches hold back pod events (a lagging watch: the list is current, the watch is not)
        self.pod_watch_gate: asyncio.Event | None = None
        # while set and not open, namespaced pod lists (the agent's one-pod lookups) wait: a slow API server
        self.pod_lookup_gate: asyncio.Event | None = None
        self._changed = asyncio.Event()
        self._expire = asyncio.Event()
        self._close = asyncio.Event()

    def _closing(self) -> None:
        if self.pod_lookup_gate is not None:
            self.pod_lookup_gate.set()
        self._expire.set()
        self._changed.set()

    # --- scripting ----------------------------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, *, owner: str = "ReplicaSet", mirror: bool = False,
                phase: str = "Running", node: str | None = None, ips: tuple[str, ...] = (),
                host_network: bool = False, containers: list[dict[str, Any]] | None = None,
                init_containers: list[dict[str, Any]] | None = None, labels: dict[str, str] | None = None,
                annotations: dict[str, str] | None = None) -> dict[str, Any]:
        """Create (ADDED) or replace (MODIFIED) a pod, by default on the double's node; `containers` are
        spec.containers entries (name, resources), e.g. from `container_spec`."""
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                                "ownerReferences": [{"kind": owner, "name": "x", "apiVersion": "v1", "uid": "o"}]
                                if owner else []}
        if labels:
            meta["labels"] = dict(labels)
        if annotations or mirror:
            meta["annotations"] = dict(annotations or {})
        if mirror:
            meta["annotations"]["kubernetes.io/config.mirror"] = "abc"
        spec: dict[str, Any] = {"nodeName": node or self.node_name, "containers": containers or []}
        if init_containers:
            spec["initContainers"] = init_containers
        if host_network:
            spec["hostNetwork"] = True
        status: dict[str, Any] = {"phase": phase}
        if ips:
            status["podIP"] = ips[0]
            status["podIPs"] = [{"ip": ip} for ip in ips]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status}
        kind = "MODIFIED" if (namespace, name) in self.pods else "ADDED"
        self._write_pod(kind, pod)
        return pod

    def update_pod(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A merge patch of a pod (e.g. the kubelet reporting its IPs), seen by watches as MODIFIED."""
        self._write_pod("MODIFIED", merge_patch(self.pods[(namespace, name)], patch))

    def delete_pod(self, namespace: str, name: str) -> None:
        """The pod is gone (DELETED)."""
        pod = self.pods.pop((namespace, name))
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = self._bump()
        self._record("DELETED", pod)

    def admin_patch(self, patch: dict[str, Any]) -> None:
        """A person's kubectl change to the node (e.g. uncordon)."""
        self._write_node(merge_patch(self.node, patch))

    def compact(self) -> None:
        """etcd compaction: watches from older versions get 410."""
        self.oldest_rv = self.rv

    def expire_watches(self) -> None:
        """Send 410 to every open watch."""
        self._expire.set()

    def close_watches(self) -> None:
        """End every open watch cleanly, without a bookmark (a server restart or a proxy timeout)."""
        self._close.set()
        self._close = asyncio.Event()

    def node_requests(self, since: float = float("-inf"), *, watches: bool = False) -> list[Request]:
        return [r for r in self.requests if r.at >= since and r.watch == watches and "/nodes" in r.path]

    def pod_requests(self, *, watches: bool | None = None) -> list[Request]:
        """Every request on the pods collection (lists and watches, or only one kind)."""
        return [r for r in self.requests if r.path == "/api/v1/pods" and (watches is None or r.watch == watches)]

    def namespaced_pod_requests(self) -> list[Request]:
        """Every request on a namespace's pods collection (the agent's one-pod lookups)."""
        return [r for r in self.requests if re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", r.path)]

    @property
    def annotations(self) -> dict[str, str]:
        return self.node["metadata"].get("annotations") or {}

    @property
    def labels(self) -> dict[str, str]:
        return self.node["metadata"].get("labels") or {}

    @property
    def taints(self) -> list[dict[str, str]]:
        return self.node["spec"].get("taints") or []

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.node["status"]["conditions"] if c["type"] == kind), None)

    # --- answers ------------------------------------------------------------------------------------------------

    def _bump(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self.history.append((self.rv, kind, copy.deepcopy(obj)))
        self._changed.set()
        self._changed = asyncio.Event()

    def _write_node(self, node: dict[str, Any]) -> None:
        node["metadata"]["resourceVersion"] = self._bump()
        self.node = node
        self._record("MODIFIED", node)

    def _write_pod(self, kind: str, pod: dict[str, Any]) -> None:
        pod["metadata"]["resourceVersion"] = self._bump()
        self.pods[(pod["metadata"]["namespace"], pod["metadata"]["name"])] = pod
        self._record(kind, pod)

    async def _answer(self, r: Request) -> Answer:
        fault = await self._fault(r)
        if fault is not None:
            return fault
        node_path = f"/api/v1/nodes/{self.node_name}"
        if r.path == node_path and r.method == "GET":
            return 200, self.node, {}
        if r.path == node_path and r.method == "PATCH":
            return self._patch_node(r.body)
        if r.path == node_path + "/status" and r.method == "PATCH":
            return self._patch_status(r.body)
        if r.path == "/api/v1/pods" and r.method == "GET":
            return self._list_pods(r.query)
        if (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", r.path)) and r.method == "GET":
            if self.pod_lookup_gate is not None:
                await self.pod_lookup_gate.wait()
            return self._list_pods(r.query, m.group(1))
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", r.path):
            return self._evict(m.group(1), m.group(2), r.body)
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?", r.path):
            return self._event(r, m.group(1), m.group(2))
        if m := re.fullmatch(r"/apis/coordination.k8s.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?", r.path):
            return self._lease(r, m.group(1), m.group(2))
        if r.path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" and r.method == "POST":
            return self._access_review(r.body)
        if r.path.startswith("/apis/resource.k8s.io/v1/") and (answer := self._resource(r)) is not None:
            return answer
        if (answer := self._nfd(r)) is not None:
            return answer
        return 404, status_body(404, f"{r.method} {r.path} is not served by the double", "NotFound"), {}

    def _access_review(self, body: Any) -> Answer:
        """authorization.k8s.io/v1: the spec comes back with `status` filled in, 201 Created; a spec naming
        neither resourceAttributes nor nonResourceAttributes is 400 Invalid, as the API server answers."""
        spec = body.get("spec") if isinstance(body, dict) else None
        attributes = spec.get("resourceAttributes") if isinstance(spec, dict) else None
        if not isinstance(attributes, dict):
            return 400, status_body(400, "spec.resourceAttributes: Invalid value: exactly one of "
                                         "nonResourceAttributes or resourceAttributes must be specified", "Invalid"), {}
        resource = str(attributes.get("resource") or "")
        if attributes.get("subresource"):
            resource += f"/{attributes['subresource']}"
        allowed = (str(attributes.get("group") or ""), resource, str(attributes.get("verb") or "")) not in self.denied
        status: dict[str, Any] = {"allowed": allowed}
        if allowed:
            status["reason"] = 'RBAC: allowed by ClusterRoleBinding "gpu-node-agent"'
        return 201, {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                     "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}, {}

    def _patch_node(self, body: dict[str, Any]) -> Answer:
        wanted = (body.get("metadata") or {}).pop("resourceVersion", None)
        if wanted is not None and wanted != self.node["metadata"]["resourceVersion"]:
            return 409, status_body(409, "the object has been modified; please apply your changes to the "
                                         "latest version and try again", "Conflict"), {}
        self._write_node(merge_patch(self.node, body))
        return 200, self.node, {}

    def _patch_status(self, body: dict[str, Any]) -> Answer:
        status = dict(body.get("status") or {})
        conditions = status.pop("conditions", None) or []
        # nodes/status resets only `spec` (pkg/registry/core/node/strategy.go): metadata sent here is kept
        node = merge_patch(self.node, {"status": status, "metadata": body.get("metadata") or {}})
        merged = [dict(c) for c in node["status"].get("conditions") or []]
        for condition in conditions:  # strategic merge: patchMergeKey "type"
            existing = next((c for c in merged if c["type"] == condition["type"]), None)
            if condition.get("$patch") == "delete":  # the directive removes the entry with that key
                merged = [c for c in merged if c["type"] != condition["type"]]
            elif existing is None:
                merged.append(dict(condition))
            else:
                existing.update(condition)
        node["status"]["conditions"] = merged
        self._write_node(node)
        return 200, self.node, {}

    @staticmethod
    def _selects(selector: str, obj: dict[str, Any]) -> bool:
        """Whether `obj` matches every term of the field selector (an empty one selects everything)."""
        kind = str(obj.get("kind"))
        return all((field_value(obj, kind, name) == value) == equal
                   for name, equal, value in field_selector(selector, kind))

    def _list_pods(self, query: dict[str, str], namespace: str | None = None) -> Answer:
        selector = query.get("fieldSelector", "")
        try:
            field_selector(selector, "Pod")
        except SelectorError as exc:
            return 400, status_body(400, f'Unable to find "pods" that match label selector "", field selector '
                                         f'"{selector}": {exc}', "BadRequest"), {}
        items = [p for p in self.pods.values()
                 if (namespace is None or p["metadata"]["namespace"] == namespace) and self._selects(selector, p)]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                     "items": items}, {}

    def _evict(self, namespace: str, name: str, body: dict[str, Any]) -> Answer:
        assert body["apiVersion"] == "policy/v1" and body["kind"] == "Eviction", body
        script = self.evictions.get((namespace, name))
        status = script.pop(0) if script else 201
        if status == 429:
            return 429, status_body(429, "Cannot evict pod as it would violate the pod's disruption budget.",
                                    "TooManyRequests"), {"Retry-After": "7"}
        if status == 500:
            return 500, status_body(500, "This pod has more than one PodDisruptionBudget, which the eviction "
                                         "subresource does not support.", "InternalError"), {}
        if (namespace, name) not in self.pods:
            return 404, status_body(404, f'pods "{name}" not found', "NotFound"), {}
        self.delete_pod(namespace, name)
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}, {}

    async def _watch(self, r: Request, writer: asyncio.StreamWriter) -> None:
        fault = await self._fault(r)
        if fault is not None:
            await self._respond(writer, *fault)
            return
        node_watch = r.path == "/api/v1/nodes" and r.query.get("fieldSelector") == f"metadata.name={self.node_name}"
        if not node_watch and r.path != "/api/v1/pods":
            await self._respond(writer, 404, status_body(404, "watch not served", "NotFound"))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.open_watches += 1
        try:
            await self._stream(r, writer, "Node" if node_watch else "Pod")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.open_watches -= 1

    async def _stream(self, r: Request, writer: asyncio.StreamWriter, kind: str) -> None:
        async def send(event: dict[str, Any]) -> None:
            await self.send_chunk(writer, event)

        selector = r.query.get("fieldSelector", "")
        since = int(r.query.get("resourceVersion") or self.rv)
        if since < self.oldest_rv:
            await send({"type": "ERROR", "object": status_body(410, "too old resource version", "Expired")})
            return
        deadline = self.clock.now() + int(r.query.get("timeoutSeconds", "1800"))
        expire, close = self._expire, self._close
        while True:
            for rv, event_type, obj in self.history:
                if rv > since and obj.get("kind") == kind and self._selects(selector, obj):
                    if kind == "Pod" and self.pod_watch_gate is not None:
                        await self.pod_watch_gate.wait()
                    await send({"type": event_type, "object": obj})
                    since = rv
            if expire.is_set():
                self._expire = asyncio.Event()
                await send({"type": "ERROR", "object": status_body(410, "too old resource version", "Expired")})
                return
            if close.is_set():
                return
            if self.clock.now() >= deadline:
                if r.query.get("allowWatchBookmarks") == "true":
                    await send({"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": "v1",
                                                               "metadata": {"resourceVersion": str(self.rv)}}})
                return
            waits = [asyncio.ensure_future(self._changed.wait()), asyncio.ensure_future(expire.wait()),
                     asyncio.ensure_future(close.wait()),
                     asyncio.ensure_future(self.clock.wait(asyncio.Event(), deadline - self.clock.now()))]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waits:
                    task.cancel()
