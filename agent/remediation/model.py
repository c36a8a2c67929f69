"""The few Kubernetes shapes remediation reads, as small frozen values, plus the errors of the API boundary.

Remediation logic never sees lightkube models or HTTP: the cluster port parses JSON into these values and turns
HTTP failures into the `Api*` exceptions below (kopf's errors.py idea), so the logic is the same against the
real API server, the test double and the in-memory simulated node.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# --- errors -----------------------------------------------------------------------------------------------------


class ApiError(Exception):
    """The API server refused or failed a request; `code` is the HTTP status (0 when there was no response)."""

    def __init__(self, code: int, message: str = "", retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}" if message else str(code))
        self.code = code
        self.message = message
        self.retry_after = retry_after


class ApiNotFound(ApiError):
    """404: the object does not exist (for an eviction: the pod is already gone)."""


class ApiConflict(ApiError):
    """409: a resourceVersion precondition failed or the object already exists; re-read and retry."""


class ApiGone(ApiError):
    """410: the watch resourceVersion is too old; re-read the object and watch from the new version."""


class ApiTooManyRequests(ApiError):
    """429: API priority-and-fairness throttling, or a PodDisruptionBudget refusing an eviction."""


class ApiServerError(ApiError):
    """5xx; for an eviction, 500 means misconfiguration such as several PDBs selecting the pod."""


class ApiTimeout(ApiError):
    """No answer within the request timeout."""

    def __init__(self, message: str = "request timed out") -> None:
        super().__init__(0, message)


class ApiUnavailable(ApiError):
    """No connection to the API server (refused, reset, DNS)."""

    def __init__(self, message: str = "API server unreachable") -> None:
        super().__init__(0, message)


def error_for_status(code: int, message: str = "", retry_after: float | None = None) -> ApiError:
    """The exception class for an HTTP status."""
    kinds: dict[int, type[ApiError]] = {404: ApiNotFound, 409: ApiConflict, 410: ApiGone, 429: ApiTooManyRequests}
    kind = kinds.get(code, ApiServerError if code >= 500 else ApiError)
    return kind(code, message, retry_after)


# --- time -------------------------------------------------------------------------------------------------------


def format_time(epoch: float) -> str:
    """RFC 3339 with seconds, as metav1.Time serialises."""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_micro_time(epoch: float) -> str:
    """RFC 3339 with microseconds, as metav1.MicroTime (Lease times) serialises."""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp; None for empty or malformed input."""
    if not text:
        return None
    try:
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


# --- objects ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Taint:
    """One entry of `spec.taints`."""

    key: str
    effect: str
    value: str = ""

    def to_dict(self) -> dict[str, str]:
        """JSON form for a patch."""
        out = {"key": self.key, "effect": self.effect}
        if self.value:
            out["value"] = self.value
        return out


@dataclass(frozen=True)
class Condition:
    """One entry of `status.conditions` (NPD convention for problem types: True means a problem)."""

    type: str
    status: str
    reason: str = ""
    message: str = ""
    last_heartbeat: float | None = None
    last_transition: float | None = None

    def to_dict(self) -> dict[str, str]:
        """JSON form for a strategic-merge patch of nodes/status."""
        out = {"type": self.type, "status": self.status, "reason": self.reason, "message": self.message}
        if self.last_heartbeat is not None:
            out["lastHeartbeatTime"] = format_time(self.last_heartbeat)
        if self.last_transition is not None:
            out["lastTransitionTime"] = format_time(self.last_transition)
        return out


@dataclass(frozen=True)
class NodeView:
    """What remediation needs of the Node object."""

    name: str
    resource_version: str = ""
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)
    conditions: Mapping[str, Condition] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeView:
        """Parse a Node as JSON (a dict)."""
        meta = data.get("metadata") or {}
        spec = data.get("spec") or {}
        status = data.get("status") or {}
        taints = tuple(Taint(t.get("key", ""), t.get("effect", ""), t.get("value") or "")
                       for t in spec.get("taints") or ())
        conditions = {c["type"]: Condition(c["type"], c.get("status", "Unknown"), c.get("reason") or "",
                                           c.get("message") or "", parse_time(c.get("lastHeartbeatTime")),
                                           parse_time(c.get("lastTransitionTime")))
                      for c in status.get("conditions") or () if c.get("type")}
        return cls(name=meta.get("name", ""), resource_version=str(meta.get("resourceVersion") or ""),
                   unschedulable=bool(spec.get("unschedulable")), taints=taints,
                   annotations=dict(meta.get("annotations") or {}), conditions=conditions)

    def taint(self, key: str) -> Taint | None:
        """The first taint with this key, if any."""
        return next((t for t in self.taints if t.key == key), None)


@dataclass(frozen=True)
class PodView:
    """What drain needs of a Pod."""

    namespace: str
    name: str
    owner_kinds: tuple[str, ...] = ()
    mirror: bool = False
    phase: str = "Running"
    terminating: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PodView:
        """Parse a Pod as JSON (a dict)."""
        meta = data.get("metadata") or {}
        owners = tuple(o.get("kind", "") for o in meta.get("ownerReferences") or ())
        return cls(namespace=meta.get("namespace", ""), name=meta.get("name", ""), owner_kinds=owners,
                   mirror="kubernetes.io/config.mirror" in (meta.get("annotations") or {}),
                   phase=(data.get("status") or {}).get("phase") or "Pending",
                   terminating=bool(meta.get("deletionTimestamp")))


@dataclass(frozen=True)
class LeaseView:
    """A coordination.k8s.io/v1 Lease used as a remediation slot."""

    name: str
    holder: str = ""
    duration: float = 0.0
    renew_time: float | None = None
    acquire_time: float | None = None
    transitions: int = 0
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def expired(self, now: float) -> bool:
        """Free to take: no holder, never renewed, or renewTime + duration has passed."""
        return not self.holder or self.renew_time is None or self.renew_time + self.duration <= now

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LeaseView:
        """Parse a Lease as JSON (a dict)."""
        meta = data.get("metadata") or {}
        spec = data.get("spec") or {}
        return cls(name=meta.get("name", ""), holder=spec.get("holderIdentity") or "",
                   duration=float(spec.get("leaseDurationSeconds") or 0),
                   renew_time=parse_time(spec.get("renewTime")), acquire_time=parse_time(spec.get("acquireTime")),
                   transitions=int(spec.get("leaseTransitions") or 0),
                   resource_version=str(meta.get("resourceVersion") or ""), labels=dict(meta.get("labels") or {}))

    def to_dict(self, namespace: str) -> dict[str, Any]:
        """JSON form for create or replace (replace carries resourceVersion as its precondition)."""
        meta: dict[str, Any] = {"name": self.name, "namespace": namespace, "labels": dict(self.labels)}
        if self.resource_version:
            meta["resourceVersion"] = self.resource_version
        spec: dict[str, Any] = {"holderIdentity": self.holder or None,
                                "leaseDurationSeconds": int(self.duration), "leaseTransitions": self.transitions}
        if self.renew_time is not None:
            spec["renewTime"] = format_micro_time(self.renew_time)
        if self.acquire_time is not None:
            spec["acquireTime"] = format_micro_time(self.acquire_time)
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}


@dataclass(frozen=True)
class EventRecord:
    """A core/v1 Event about the Node; `name` is set once created, and `count` grows as repeats are folded in."""

    reason: str
    message: str
    type: str = "Normal"
    name: str = ""
    count: int = 1
    first_time: float = 0.0
    last_time: float = 0.0


@dataclass(frozen=True)
class WatchEvent:
    """One line of a Node watch: ADDED / MODIFIED / DELETED with the node, or BOOKMARK with only a version."""

    type: str
    resource_version: str
    node: NodeView | None = None
