"""The requests the cluster port may make (what deploy/rbac.yaml grants), checked against a double's record."""

from __future__ import annotations

import re

from tests.fakes.httpdouble import Request


def allowed(node: str, lease_namespace: str) -> list[tuple[str, str]]:
    """(method, path regex) of every request `agent.kube.port` may send."""
    return [
        ("GET", rf"/api/v1/nodes/{node}"), ("PATCH", rf"/api/v1/nodes/{node}"),
        ("PATCH", rf"/api/v1/nodes/{node}/status"),
        ("GET", r"/api/v1/nodes"),  # watch only, checked below
        ("GET", r"/api/v1/pods"), ("GET", r"/api/v1/namespaces/[^/]+/pods"),  # lists by node (and name), below
        ("POST", r"/api/v1/namespaces/[^/]+/pods/[^/]+/eviction"),
        # Events about the node live in `default`; Events about a pod in the pod's namespace
        ("POST", r"/api/v1/namespaces/[^/]+/events"), ("PATCH", r"/api/v1/namespaces/[^/]+/events/[^/]+"),
        ("GET", rf"/apis/coordination.k8s.io/v1/namespaces/{lease_namespace}/leases"),
        ("POST", rf"/apis/coordination.k8s.io/v1/namespaces/{lease_namespace}/leases"),
        ("PUT", rf"/apis/coordination.k8s.io/v1/namespaces/{lease_namespace}/leases/[^/]+"),
        ("GET", r"/apis/resource.k8s.io/v1/resourceslices"), ("POST", r"/apis/resource.k8s.io/v1/resourceslices"),
        ("PUT", rf"/apis/resource.k8s.io/v1/resourceslices/{node}-[^/]+"),
        ("DELETE", rf"/apis/resource.k8s.io/v1/resourceslices/{node}-[^/]+"),
        ("GET", r"/apis/resource.k8s.io/v1/namespaces/[^/]+/resourceclaims/[^/]+"),
        # node labels: NFD's discovery document (system:discovery), NodeFeatures in the agent's namespace, and
        # reads of GPU Feature Discovery's in its namespace
        ("GET", r"/apis/nfd.k8s-sigs.io/v1alpha1"),
        ("GET", r"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/[^/]+/nodefeatures/[^/]+"),
        ("POST", rf"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{lease_namespace}/nodefeatures"),
        ("PUT", rf"/apis/nfd.k8s-sigs.io/v1alpha1/namespaces/{lease_namespace}/nodefeatures/[^/]+"),
        # doctor's RBAC check; every authenticated identity may (system:basic-user)
        ("POST", r"/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"),
    ]


def assert_only_allowed(requests: list[Request], node: str, lease_namespace: str) -> None:
    """Every request is one the RBAC rules grant, and nothing lists or watches cluster-wide: node watches are
    by name, every pod list or watch carries `fieldSelector=spec.nodeName=<node>`, and a namespaced pod list
    names one pod as well."""
    rules = allowed(node, lease_namespace)
    for r in requests:
        assert any(r.method == m and re.fullmatch(p, r.path) for m, p in rules), (r.method, r.path)
        if r.path == "/api/v1/nodes":
            assert r.watch and r.query.get("fieldSelector") == f"metadata.name={node}", r
        if r.path == "/api/v1/pods":
            assert r.query.get("fieldSelector") == f"spec.nodeName={node}", r
        if re.fullmatch(r"/api/v1/namespaces/[^/]+/pods", r.path):  # one pod of this node: by name and node
            terms = r.query.get("fieldSelector", "").split(",")
            assert not r.watch and f"spec.nodeName={node}" in terms and any(
                t.startswith("metadata.name=") for t in terms), r
        if r.path == "/apis/resource.k8s.io/v1/resourceslices" and r.method == "GET":
            assert f"spec.nodeName={node}" in r.query.get("fieldSelector", "").split(","), r
