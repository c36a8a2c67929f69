"""A Kubernetes API double serving real HTTP/1.1 on 127.0.0.1, which lightkube talks to unmodified.

It implements just the endpoints the agent may use, with the semantics the agent relies on and that kmock does
not emulate: merge patch with the resourceVersion precondition (409), strategic merge of `status.conditions` by
type, the `spec.nodeName` field selector, watches with resourceVersion / bookmarks / timeoutSeconds / 410, the
Eviction subresource, Events with generateName, and Leases with create-409 and replace-409. Everything else
answers 404 and is recorded, so tests can assert the agent made no other request. Faults (status codes,
delays for client timeouts) are scripted per method and path. Watch timeouts follow the injected clock.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import re
from typing import Any

from tests.remediation.fakes import FakeClock
from tests.remediation.httpdouble import Answer, HttpDouble, Request, status_body


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class ApiServerDouble(HttpDouble):
    """One node, its pods, Events and Leases, over HTTP."""

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
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.oldest_rv = 0
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.events: dict[str, dict[str, Any]] = {}
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.evictions: dict[tuple[str, str], list[int]] = {}
        self.open_watches = 0
        self._changed = asyncio.Event()
        self._expire = asyncio.Event()

    def _closing(self) -> None:
        self._expire.set()
        self._changed.set()

    # --- scripting ----------------------------------------------------------------------------------------------

    def add_pod(self, namespace: str, name: str, *, owner: str = "ReplicaSet", mirror: bool = False,
                phase: str = "Running", node: str | None = None) -> None:
        meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}",
                                "ownerReferences": [{"kind": owner, "name": "x", "apiVersion": "v1", "uid": "o"}]
                                if owner else []}
        if mirror:
            meta["annotations"] = {"kubernetes.io/config.mirror": "abc"}
        self.pods[(namespace, name)] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                                        "spec": {"nodeName": node or self.node_name, "containers": []},
                                        "status": {"phase": phase}}

    def admin_patch(self, patch: dict[str, Any]) -> None:
        """A person's kubectl change to the node (e.g. uncordon)."""
        self._write_node(merge_patch(self.node, patch))

    def compact(self) -> None:
        """etcd compaction: watches from older versions get 410."""
        self.oldest_rv = self.rv

    def expire_watches(self) -> None:
        """Send 410 to every open watch."""
        self._expire.set()

    def node_requests(self, since: float = float("-inf"), *, watches: bool = False) -> list[Request]:
        return [r for r in self.requests if r.at >= since and r.watch == watches]

    @property
    def annotations(self) -> dict[str, str]:
        return self.node["metadata"].get("annotations") or {}

    @property
    def taints(self) -> list[dict[str, str]]:
        return self.node["spec"].get("taints") or []

    def condition(self, kind: str) -> dict[str, Any] | None:
        return next((c for c in self.node["status"]["conditions"] if c["type"] == kind), None)

    # --- answers ------------------------------------------------------------------------------------------------

    def _bump(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _write_node(self, node: dict[str, Any]) -> None:
        node["metadata"]["resourceVersion"] = self._bump()
        self.node = node
        self.history.append((self.rv, "MODIFIED", copy.deepcopy(node)))
        self._changed.set()
        self._changed = asyncio.Event()

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
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", r.path):
            return self._evict(m.group(1), m.group(2), r.body)
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/events(?:/([^/]+))?", r.path):
            return self._event(r, m.group(1), m.group(2))
        if m := re.fullmatch(r"/apis/coordination.k8s.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?", r.path):
            return self._lease(r, m.group(1), m.group(2))
        return 404, status_body(404, f"{r.method} {r.path} is not served by the double", "NotFound"), {}

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
        node = merge_patch(self.node, {"status": status})
        merged = [dict(c) for c in node["status"].get("conditions") or []]
        for condition in conditions:  # strategic merge: patchMergeKey "type"
            existing = next((c for c in merged if c["type"] == condition["type"]), None)
            if existing is None:
                merged.append(dict(condition))
            else:
                existing.update(condition)
        node["status"]["conditions"] = merged
        self._write_node(node)
        return 200, self.node, {}

    def _list_pods(self, query: dict[str, str]) -> Answer:
        selector = query.get("fieldSelector", "")
        items = [p for p in self.pods.values() if selector == f"spec.nodeName={p['spec']['nodeName']}"] \
            if selector else list(self.pods.values())
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
        del self.pods[(namespace, name)]
        return 201, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}, {}

    def _event(self, r: Request, namespace: str, name: str | None) -> Answer:
        if r.method == "POST" and name is None:
            event = dict(r.body)
            meta = dict(event.get("metadata") or {})
            meta["name"] = meta.get("name") or f"{meta.get('generateName', 'event.')}{len(self.events):05x}"
            meta["namespace"] = namespace
            meta["resourceVersion"] = self._bump()
            event["metadata"] = meta
            self.events[meta["name"]] = event
            return 201, event, {}
        if r.method == "PATCH" and name is not None:
            if name not in self.events:
                return 404, status_body(404, f'events "{name}" not found', "NotFound"), {}
            self.events[name] = merge_patch(self.events[name], r.body)
            return 200, self.events[name], {}
        return 404, status_body(404, "no such event route", "NotFound"), {}

    def _lease(self, r: Request, namespace: str, name: str | None) -> Answer:
        if r.method == "GET" and name is None:
            wanted = dict(part.split("=", 1) for part in r.query.get("labelSelector", "").split(",") if part)
            items = [le for (ns, _), le in self.leases.items() if ns == namespace
                     and all((le["metadata"].get("labels") or {}).get(k) == v for k, v in wanted.items())]
            return 200, {"kind": "LeaseList", "apiVersion": "coordination.k8s.io/v1",
                         "metadata": {"resourceVersion": str(self.rv)}, "items": items}, {}
        if r.method == "POST" and name is None:
            key = (namespace, r.body["metadata"]["name"])
            if key in self.leases:
                return 409, status_body(409, f'leases "{key[1]}" already exists', "AlreadyExists"), {}
            lease = copy.deepcopy(r.body)
            lease["metadata"]["resourceVersion"] = self._bump()
            self.leases[key] = lease
            return 201, lease, {}
        if r.method == "PUT" and name is not None:
            current = self.leases.get((namespace, name))
            if current is None:
                return 404, status_body(404, f'leases "{name}" not found', "NotFound"), {}
            if r.body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
                return 409, status_body(409, "the object has been modified", "Conflict"), {}
            lease = copy.deepcopy(r.body)
            lease["metadata"]["resourceVersion"] = self._bump()
            self.leases[(namespace, name)] = lease
            return 200, lease, {}
        return 404, status_body(404, "no such lease route", "NotFound"), {}

    async def _watch(self, r: Request, writer: asyncio.StreamWriter) -> None:
        fault = await self._fault(r)
        if fault is not None:
            await self._respond(writer, *fault)
            return
        if r.path != "/api/v1/nodes" or r.query.get("fieldSelector") != f"metadata.name={self.node_name}":
            await self._respond(writer, 404, status_body(404, "watch not served", "NotFound"))
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        self.open_watches += 1
        try:
            await self._stream(r, writer)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.open_watches -= 1

    async def _stream(self, r: Request, writer: asyncio.StreamWriter) -> None:
        async def send(event: dict[str, Any]) -> None:
            await self.send_chunk(writer, event)

        since = int(r.query.get("resourceVersion") or self.rv)
        if since < self.oldest_rv:
            await send({"type": "ERROR", "object": status_body(410, "too old resource version", "Expired")})
            return
        deadline = self.clock.now() + int(r.query.get("timeoutSeconds", "1800"))
        expire = self._expire
        while True:
            for rv, kind, obj in self.history:
                if rv > since:
                    await send({"type": kind, "object": obj})
                    since = rv
            if expire.is_set():
                self._expire = asyncio.Event()
                await send({"type": "ERROR", "object": status_body(410, "too old resource version", "Expired")})
                return
            if self.clock.now() >= deadline:
                if r.query.get("allowWatchBookmarks") == "true":
                    await send({"type": "BOOKMARK", "object": {"kind": "Node", "apiVersion": "v1",
                                                               "metadata": {"resourceVersion": str(self.rv)}}})
                return
            changed = self._changed
            wake = asyncio.ensure_future(changed.wait())
            stop = asyncio.ensure_future(expire.wait())
            tick = asyncio.ensure_future(self.clock.wait(asyncio.Event(), deadline - self.clock.now()))
            try:
                await asyncio.wait({wake, stop, tick}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (wake, stop, tick):
                    task.cancel()
