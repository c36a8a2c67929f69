"""RBAC grants exactly what the code calls: every operation of the real cluster port is run through lightkube's
real request builder, each HTTP request is classified the way the API server authorizes it (API group,
resource[/subresource], verb), and the set must equal what deploy/rbac.yaml plus deploy/dra/rbac.yaml and
deploy/gfd-read/rbac.yaml grant.
A verb granted but never used fails, and so does a request that no rule grants.

The transport below answers every request with a minimal valid object (it stands in for the API server only
so that lightkube completes each call; the API double in tests/fakes checks behaviour elsewhere).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import httpx2
import yaml
from lightkube import AsyncClient, KubeConfig

from agent.kube.cluster import FIELD_MANAGER, LightkubeCluster
from agent.kube.model import Condition, EventRecord, LeaseView
from agent.kube.transport import request_verb
from tests.deploy.manifests import DEPLOY
from tests.fakes.apiserver import write_kubeconfig

NODE = "gpu-node-1"
NS = "gpu-node-agent"


def _classify(method: str, path: str, query: str) -> tuple[str, str, str]:
    """(API group, resource[/subresource], verb) of one request, as the API server's RBAC sees it."""
    parts = [p for p in path.split("/") if p]
    group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
    if not rest:  # an API discovery document: a non-resource URL
        return "", path, method.lower()
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    return group, resource, request_verb(method, path, query)


class _Answering(httpx2.AsyncBaseTransport):
    """Records each request and answers it with the smallest object lightkube accepts."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, str]] = set()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        path, query = request.url.path, request.url.query.decode()
        self.seen.add(_classify(request.method, path, query))
        if request.method == "GET" and "watch=true" in query:
            return httpx2.Response(200, content=b"")
        if path.startswith("/apis/") and len([p for p in path.split("/") if p]) == 3:  # discovery
            return _json({"kind": "APIResourceList", "resources": [{"name": "nodefeatures"}]})
        parts = [p for p in path.split("/") if p]
        kind_path = parts[2:] if parts[0] == "api" else parts[3:]
        if kind_path[:1] == ["namespaces"]:
            kind_path = kind_path[2:]
        if request.method == "GET" and len(kind_path) == 1:
            return _json({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": []})
        body: dict[str, Any] = json.loads(request.content) if request.content else {}
        if not isinstance(body, dict):
            body = {}
        status = body.get("status")
        if isinstance(status, dict) and isinstance(status.get("conditions"), list):  # the server applies `$patch`
            status["conditions"] = [c for c in status["conditions"] if "$patch" not in c]
        metadata = {"name": kind_path[1] if len(kind_path) > 1 else "created-1", "resourceVersion": "2",
                    "uid": "u-1", **(body.get("metadata") or {})}
        metadata.pop("generateName", None)
        extra = {"involvedObject": {"kind": "Node", "name": NODE}} if "/events" in path else {}
        return _json({**extra, **body, "metadata": metadata, "spec": body.get("spec") or {}})


def _json(data: dict[str, Any]) -> httpx2.Response:
    return httpx2.Response(200, content=json.dumps(data).encode(), headers={"Content-Type": "application/json"})


async def _exercise(port: LightkubeCluster) -> None:
    """Every operation of the port, each path a caller can take (create or patch an Event, create or replace a
    Lease). The method list is checked against the class, so a new operation cannot skip this test."""
    calls = {
        "get_node": port.get_node,
        "node_uid": port.node_uid,
        "patch_node": lambda: port.patch_node({"spec": {"unschedulable": True}}, "1"),
        "patch_node_condition": lambda: port.patch_node_condition(Condition("GpuUnhealthy", "True", "r", "m", 1.0,
                                                                            1.0)),
        "remove_node_condition": lambda: port.remove_node_condition("GpuNodeRebootRequired"),
        "watch_node": lambda: _drain(port.watch_node("1", 300)),
        "watch_pods": lambda: _drain(port.watch_pods("1", 300)),
        "list_pods": port.list_pods,
        "list_node_pods": port.list_node_pods,
        "find_node_pod": lambda: port.find_node_pod("team", "train-0"),
        "evict_pod": lambda: port.evict_pod("team", "train-0"),
        "write_event": lambda: _events(port),
        "list_leases": lambda: port.list_leases(NS, {"a": "b"}),
        "write_lease": lambda: _leases(port),
        "list_resource_slices": lambda: port.list_resource_slices("gpu.gpunodeagent.io"),
        "create_resource_slice": lambda: port.create_resource_slice(_slice()),
        "replace_resource_slice": lambda: port.replace_resource_slice(
            {**_slice(), "metadata": {"name": f"{NODE}-x", "resourceVersion": "1"}}),
        "delete_resource_slice": lambda: port.delete_resource_slice(f"{NODE}-x"),
        "get_resource_claim": lambda: port.get_resource_claim("team", "claim-0"),
        "review_access": lambda: port.review_access("patch", "nodes"),
        "node_features_served": port.node_features_served,
        "get_node_feature": lambda: port.get_node_feature(NS, f"gpu-node-agent-{NODE}"),
        "create_node_feature": lambda: port.create_node_feature(NS, _feature()),
        "replace_node_feature": lambda: port.replace_node_feature(
            NS, {**_feature(), "metadata": {"name": f"gpu-node-agent-{NODE}", "resourceVersion": "1"}}),
    }
    public = {name for name, member in inspect.getmembers(LightkubeCluster, inspect.isfunction)
              if not name.startswith("_") and name != "aclose"}
    assert public == set(calls), f"port operations not exercised here: {sorted(public - set(calls))}"
    for call in calls.values():
        await call()


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


async def _events(port: LightkubeCluster) -> None:
    created = await port.write_event(EventRecord("GpuXid79", "lost", "Warning", "", 1, 1.0, 1.0))
    await port.write_event(EventRecord("GpuXid79", "lost", "Warning", created.name or "e-1", 2, 1.0, 2.0))


async def _leases(port: LightkubeCluster) -> None:
    await port.write_lease(NS, LeaseView("slot-0", holder=NODE, duration=60.0))
    await port.write_lease(NS, LeaseView("slot-0", holder=NODE, duration=60.0, resource_version="3"))


def _slice() -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"{NODE}-"},
            "spec": {"driver": "gpu.gpunodeagent.io", "nodeName": NODE,
                     "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": []}}


def _feature() -> dict[str, Any]:
    return {"apiVersion": "nfd.k8s-sigs.io/v1alpha1", "kind": "NodeFeature",
            "metadata": {"name": f"gpu-node-agent-{NODE}", "labels": {"nfd.node.kubernetes.io/node-name": NODE}},
            "spec": {"labels": {"gpunodeagent.io/gpu.expected": "8"}}}


# Granted to every authenticated identity by the built-in ClusterRoles system:basic-user (doctor's RBAC check)
# and system:discovery (API discovery documents: whether NFD's NodeFeature is served)
BUILT_IN = {("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
            ("", "/apis/nfd.k8s-sigs.io/v1alpha1", "get")}


def _granted() -> set[tuple[str, str, str]]:
    granted: set[tuple[str, str, str]] = set()
    for path in (DEPLOY / "rbac.yaml", DEPLOY / "dra" / "rbac.yaml", DEPLOY / "gfd-read" / "rbac.yaml"):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not doc or doc.get("kind") not in ("ClusterRole", "Role"):
                continue
            for rule in doc["rules"]:
                granted |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return granted


async def test_rbac_grants_exactly_the_requests_the_code_makes(tmp_path: Path) -> None:
    transport = _Answering()
    config = KubeConfig.from_file(write_kubeconfig(tmp_path / "kc", "http://api.invalid")).get()
    port = LightkubeCluster(AsyncClient(config, transport=transport, field_manager=FIELD_MANAGER), NODE,
                            "default")
    try:
        await _exercise(port)
    finally:
        await port.aclose()
    granted = _granted() | BUILT_IN
    assert transport.seen - granted == set(), "requests the RBAC rules do not grant"
    assert granted - transport.seen == set(), "verbs granted that the code never uses"
