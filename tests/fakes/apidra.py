"""The resource.k8s.io/v1 endpoints of the API double (a mixin): ResourceSlices and ResourceClaims.

Slices: list with the `spec.nodeName` / `spec.driver` field selectors (comma-separated, as lightkube sends them),
create (409 on a taken name), get, replace (409 on a stale resourceVersion), delete. Creates and replaces are
validated as the API server's `resource.k8s.io/v1` validation does for what a node-local driver writes
(k8s.io/api/resource/v1/types.go constants; `/work/shared/reference/dra.md` sections 5.1-5.3): 422 Invalid for
more than 128 devices (64 once a device carries taints), more than 32 attributes per device, string values over
64 characters, device names that are not DNS labels, duplicate names, a missing or non-positive
`resourceSliceCount`, more than one of the node-selection fields, and unknown taint effects. Claims: GET by
namespace and name; tests put them with `put_claim` (the scheduler's role).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from tests.fakes.httpdouble import Answer, Request, status_body

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = re.compile(r"/apis/resource.k8s.io/v1/namespaces/([^/]+)/resourceclaims/([^/]+)")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_EFFECTS = {"None", "NoSchedule", "NoExecute"}


def slice_problems(obj: dict[str, Any]) -> list[str]:
    """What `resource.k8s.io/v1` validation would refuse in a node-local slice."""
    spec = obj.get("spec") or {}
    devices = spec.get("devices") or []
    problems: list[str] = []
    pool = spec.get("pool") or {}
    if not pool.get("name") or int(pool.get("resourceSliceCount") or 0) <= 0 or int(pool.get("generation", -1)) < 0:
        problems.append("spec.pool: name, generation >= 0 and resourceSliceCount > 0 are required")
    if sum(1 for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(key)) != 1:
        problems.append("spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection")
    limit = 64 if any(d.get("taints") for d in devices) else 128
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    names = [d.get("name", "") for d in devices]
    if len(set(names)) != len(names):
        problems.append("spec.devices: Duplicate value: device names")
    for device in devices:
        name = device.get("name", "")
        if not _DNS_LABEL.match(name):
            problems.append(f"spec.devices[{name}].name: not a DNS label")
        attributes = device.get("attributes") or {}
        if len(attributes) + len(device.get("capacity") or {}) > 32:
            problems.append(f"spec.devices[{name}]: more than 32 attributes and capacities")
        for key, value in attributes.items():
            if len(value) != 1 or not set(value) <= {"int", "bool", "string", "version"}:
                problems.append(f"spec.devices[{name}].attributes[{key}]: exactly one value required")
            text = value.get("string") or value.get("version") or ""
            if len(text) > 64:
                problems.append(f"spec.devices[{name}].attributes[{key}]: longer than 64 characters")
        if len(device.get("taints") or []) > 16:
            problems.append(f"spec.devices[{name}].taints: more than 16")
        for taint in device.get("taints") or []:
            if taint.get("effect") not in _EFFECTS or not taint.get("key"):
                problems.append(f"spec.devices[{name}].taints: key and a known effect required")
    return problems


class ResourceApi:
    """ResourceSlices (cluster-scoped) and ResourceClaims (namespaced). Needs `rv` and `_bump()`."""

    rv: int
    node: dict[str, Any]
    resource_slices: dict[str, dict[str, Any]]
    resource_claims: dict[tuple[str, str], dict[str, Any]]

    def _bump(self) -> str:
        raise NotImplementedError

    def put_claim(self, claim: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a claim (the scheduler writing its allocation)."""
        claim = copy.deepcopy(claim)
        meta = claim.setdefault("metadata", {})
        meta["resourceVersion"] = self._bump()
        self.resource_claims[(meta.get("namespace", "default"), meta["name"])] = claim
        return claim

    def delete_claim(self, namespace: str, name: str) -> None:
        """The claim is gone (its pod ended)."""
        self.resource_claims.pop((namespace, name), None)

    def _resource(self, r: Request) -> Answer | None:
        """The answer for a resource.k8s.io request, None when the path is not one."""
        if m := CLAIMS.fullmatch(r.path):
            claim = self.resource_claims.get((m.group(1), m.group(2)))
            if r.method != "GET" or claim is None:
                return 404, status_body(404, f'resourceclaims.resource.k8s.io "{m.group(2)}" not found',
                                        "NotFound"), {}
            return 200, claim, {}
        if r.path == SLICES and r.method == "GET":
            return self._list_slices(r.query.get("fieldSelector", ""))
        if r.path == SLICES and r.method == "POST":
            return self._write_slice(r.body, create=True)
        if r.path.startswith(SLICES + "/"):
            name = r.path.removeprefix(SLICES + "/")
            current = self.resource_slices.get(name)
            if current is None:
                return 404, status_body(404, f'resourceslices.resource.k8s.io "{name}" not found', "NotFound"), {}
            if r.method == "GET":
                return 200, current, {}
            if r.method == "PUT":
                return self._write_slice(r.body, create=False)
            if r.method == "DELETE":
                del self.resource_slices[name]
                return 200, current, {}
        return None

    def _list_slices(self, selector: str) -> Answer:
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        unknown = set(wanted) - {"spec.nodeName", "spec.driver"}
        if unknown:
            return 400, status_body(400, f"field label not supported: {sorted(unknown)}", "BadRequest"), {}
        items = [s for s in self.resource_slices.values()
                 if all(str(s["spec"].get(k.removeprefix("spec."))) == v for k, v in wanted.items())]
        return 200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                     "metadata": {"resourceVersion": str(self.rv)}, "items": copy.deepcopy(items)}, {}

    def _write_slice(self, body: dict[str, Any], *, create: bool) -> Answer:
        name = (body.get("metadata") or {}).get("name", "")
        current = self.resource_slices.get(name)
        if create and current is not None:
            return 409, status_body(409, f'resourceslices.resource.k8s.io "{name}" already exists',
                                    "AlreadyExists"), {}
        if not create and current is not None and \
                body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            return 409, status_body(409, "the object has been modified", "Conflict"), {}
        if problems := slice_problems(body):
            return 422, status_body(422, f'ResourceSlice.resource.k8s.io "{name}" is invalid: '
                                         + "; ".join(problems), "Invalid"), {}
        stored = copy.deepcopy(body)
        stored["apiVersion"], stored["kind"] = "resource.k8s.io/v1", "ResourceSlice"
        stored["metadata"]["resourceVersion"] = self._bump()
        for device in stored["spec"].get("devices") or []:
            for taint in device.get("taints") or []:  # the API server fills timeAdded
                taint.setdefault("timeAdded", "2026-11-23T20:00:00Z")
        self.resource_slices[name] = stored
        return (201 if create else 200), stored, {}
