"""NFD's `nfd.k8s-sigs.io/v1alpha1` NodeFeatures in the API double (a mixin), served or not (`nfd_served`).

Served: the group version's discovery document lists `nodefeatures`; GET / POST (409 on a taken name) / PUT
(422 without `metadata.resourceVersion`, 409 when it is stale: custom resources take no unconditional update) in
any namespace; PATCH with a strategic-merge body is 415, as for every custom resource; a body without `spec`
is 422 (the CRD requires it) and `spec.labels` must map strings to strings. Not served (NFD not installed):
every path under the group answers 404 with the API server's plain-text "404 page not found".
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tests.fakes.httpdouble import Answer, Request, status_body

GROUP_VERSION = "/apis/nfd.k8s-sigs.io/v1alpha1"
FEATURES = re.compile(GROUP_VERSION + r"/namespaces/([^/]+)/nodefeatures(?:/([^/]+))?")


class NodeFeatureApi:
    """NodeFeatures by (namespace, name). Needs `rv` and `_bump()`."""

    rv: int
    requests: list[Request]
    nfd_served: bool
    node_features: dict[tuple[str, str], dict[str, Any]]

    def _bump(self) -> str:
        raise NotImplementedError

    def put_node_feature(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a NodeFeature as another writer (GPU Feature Discovery, a person)."""
        stored = copy.deepcopy(body)
        stored.setdefault("apiVersion", "nfd.k8s-sigs.io/v1alpha1")
        stored.setdefault("kind", "NodeFeature")
        stored["metadata"]["namespace"] = namespace
        stored["metadata"]["resourceVersion"] = self._bump()
        self.node_features[(namespace, stored["metadata"]["name"])] = stored
        return stored

    def feature_requests(self, *, writes: bool = False) -> list[Request]:
        """Every request on NodeFeatures (only POST/PUT/PATCH/DELETE with `writes`)."""
        return [r for r in self.requests if FEATURES.fullmatch(r.path)
                and (not writes or r.method in ("POST", "PUT", "PATCH", "DELETE"))]

    def _nfd(self, r: Request) -> Answer | None:
        """The answer for a path under the group, None when the path is not one."""
        if r.path != GROUP_VERSION and not r.path.startswith(GROUP_VERSION + "/"):
            return None
        if not self.nfd_served:
            return 404, b"404 page not found", {}
        if r.path == GROUP_VERSION and r.method == "GET":
            return 200, {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "nfd.k8s-sigs.io/v1alpha1",
                         "resources": [{"name": "nodefeatures", "singularName": "nodefeature", "namespaced": True,
                                        "kind": "NodeFeature", "verbs": ["create", "delete", "get", "list", "patch",
                                                                         "update", "watch"]},
                                       {"name": "nodefeaturerules", "namespaced": False, "kind": "NodeFeatureRule",
                                        "verbs": ["get", "list", "watch"]}]}, {}
        m = FEATURES.fullmatch(r.path)
        if m is None:
            return 404, status_body(404, f"{r.method} {r.path} is not served by the double", "NotFound"), {}
        namespace, name = m.group(1), m.group(2)
        current = self.node_features.get((namespace, name or ""))
        if r.method == "GET" and name is not None:
            if current is None:
                return 404, status_body(404, f'nodefeatures.nfd.k8s-sigs.io "{name}" not found', "NotFound"), {}
            return 200, current, {}
        if r.method == "POST" and name is None:
            return self._write_feature(namespace, r.body, None)
        if r.method == "PUT" and name is not None:
            if current is None:
                return 404, status_body(404, f'nodefeatures.nfd.k8s-sigs.io "{name}" not found', "NotFound"), {}
            return self._write_feature(namespace, r.body, current)
        if r.method == "PATCH" and "strategic-merge-patch" in r.content_type:
            return 415, status_body(415, "the body of the request was in an unknown format - accepted media "
                                         "types include: application/json-patch+json, application/merge-patch+json, "
                                         "application/apply-patch+yaml", "UnsupportedMediaType"), {}
        return 405, status_body(405, f"{r.method} is not allowed here", "MethodNotAllowed"), {}

    def _write_feature(self, namespace: str, body: Any, current: dict[str, Any] | None) -> Answer:
        meta = (body or {}).get("metadata") or {}
        name = meta.get("name", "")
        if current is None and (namespace, name) in self.node_features:
            return 409, status_body(409, f'nodefeatures.nfd.k8s-sigs.io "{name}" already exists',
                                    "AlreadyExists"), {}
        if current is not None:
            if not meta.get("resourceVersion"):
                return 422, status_body(422, f'NodeFeature.nfd.k8s-sigs.io "{name}" is invalid: '
                                             "metadata.resourceVersion: Invalid value: 0x0: must be specified for an "
                                             "update", "Invalid"), {}
            if meta["resourceVersion"] != current["metadata"]["resourceVersion"]:
                return 409, status_body(409, "the object has been modified; please apply your changes to the "
                                             "latest version and try again", "Conflict"), {}
        spec = body.get("spec")
        labels = (spec or {}).get("labels") or {}
        if not isinstance(spec, dict) or not isinstance(labels, dict) or \
                not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            return 422, status_body(422, f'NodeFeature.nfd.k8s-sigs.io "{name}" is invalid: spec: Required value, '
                                         "spec.labels: strings only", "Invalid"), {}
        stored = self.put_node_feature(namespace, body)
        return (201 if current is None else 200), stored, {}
