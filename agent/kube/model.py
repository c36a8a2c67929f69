"""The few Kubernetes shapes the agent reads, as small frozen values (errors are in `agent.kube.errors`).

Remediation and network accounting never see lightkube models or HTTP: the cluster port parses JSON into these
values, so their logic is the same against the real API server, the test double and the in-memory simulated
cluster. `apply_patch` / `with_condition` are the server's merge rules for the node fields the agent writes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agent.logs import cut

T = TypeVar("T")

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
    labels: Mapping[str, str] = field(default_factory=dict)

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
                   annotations=dict(meta.get("annotations") or {}), conditions=conditions,
                   labels=dict(_string_pairs(meta.get("labels"))))

    def taint(self, key: str) -> Taint | None:
        """The first taint with this key, if any."""
        return next((t for t in self.taints if t.key == key), None)


@dataclass(frozen=True)
class ContainerSpec:
    """One container of a pod spec as device ownership needs it: which extended resources it asks for.

    `resources`: names with a '/' (device-plugin resources such as nvidia.com/gpu) whose limit (or request,
    for a spec that sets only requests) is above zero. `init`: an init container; `sidecar`: a restartable
    init container (restartPolicy Always), which the kubelet lists in PodResources like an app container.
    """

    name: str
    resources: frozenset[str] = frozenset()
    init: bool = False
    sidecar: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], init: bool = False) -> ContainerSpec:
        """Parse one entry of spec.containers or spec.initContainers."""
        resources = data.get("resources") or {}
        wanted = {**(resources.get("requests") or {}), **(resources.get("limits") or {})}
        names = frozenset(str(k) for k, v in wanted.items() if "/" in str(k) and _positive(v))
        return cls(name=str(data.get("name") or ""), resources=names, init=init,
                   sidecar=init and data.get("restartPolicy") == "Always")


def _positive(quantity: Any) -> bool:
    """Extended resources are whole numbers; anything else is not a device request."""
    try:
        return int(str(quantity)) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class OwnerRef:
    """One entry of metadata.ownerReferences (what node labels need to own their NodeFeature by the agent's Pod
    and DaemonSet)."""

    api_version: str
    kind: str
    name: str
    uid: str
    controller: bool = False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OwnerRef:
        """Parse one ownerReferences entry."""
        return cls(str(data.get("apiVersion") or ""), str(data.get("kind") or ""), str(data.get("name") or ""),
                   str(data.get("uid") or ""), bool(data.get("controller")))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (blockOwnerDeletion left unset: the agent has no finalizer rights on its owners)."""
        out: dict[str, Any] = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid}
        if self.controller:
            out["controller"] = True
        return out


@dataclass(frozen=True)
class PodView:
    """What drain, network accounting and device ownership need of a Pod."""

    namespace: str
    name: str
    owner_kinds: tuple[str, ...] = ()
    mirror: bool = False
    phase: str = "Running"
    terminating: bool = False
    ips: tuple[str, ...] = ()  # status.podIPs (status.podIP when the list is absent), as the server spells them
    host_network: bool = False
    resource_version: str = ""
    uid: str = ""
    annotations: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs
    containers: tuple[ContainerSpec, ...] = ()  # init containers first, then app containers, in spec order
    labels: tuple[tuple[str, str], ...] = ()  # metadata.labels, sorted (a tuple keeps the view hashable)
    owners: tuple[OwnerRef, ...] = ()  # metadata.ownerReferences in order

    def label(self, key: str) -> str | None:
        """One metadata.labels value, or None."""
        return dict(self.labels).get(key)

    def annotation(self, key: str) -> str | None:
        """One metadata.annotations value, or None."""
        return dict(self.annotations).get(key)

    @property
    def key(self) -> tuple[str, str]:
        """(namespace, name)."""
        return self.namespace, self.name

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PodView:
        """Parse a Pod as JSON (a dict)."""
        meta = data.get("metadata") or {}
        spec = data.get("spec") or {}
        status = data.get("status") or {}
        owners = tuple(o.get("kind", "") for o in meta.get("ownerReferences") or ())
        ips = tuple(str(entry["ip"]) for entry in status.get("podIPs") or () if (entry or {}).get("ip"))
        if not ips and status.get("podIP"):
            ips = (str(status["podIP"]),)
        return cls(namespace=meta.get("namespace", ""), name=meta.get("name", ""), owner_kinds=owners,
                   mirror="kubernetes.io/config.mirror" in (meta.get("annotations") or {}),
                   phase=status.get("phase") or "Pending", terminating=bool(meta.get("deletionTimestamp")),
                   ips=ips, host_network=bool(spec.get("hostNetwork")),
                   resource_version=str(meta.get("resourceVersion") or ""), uid=str(meta.get("uid") or ""),
                   annotations=tuple(sorted((str(k), str(v)) for k, v in (meta.get("annotations") or {}).items())),
                   containers=tuple([ContainerSpec.from_dict(c, init=True) for c in spec.get("initContainers") or ()]
                                    + [ContainerSpec.from_dict(c) for c in spec.get("containers") or ()]),
                   labels=_string_pairs(meta.get("labels")),
                   owners=tuple(OwnerRef.from_dict(o) for o in meta.get("ownerReferences") or ()
                                if isinstance(o, Mapping)))


def _string_pairs(data: Any) -> tuple[tuple[str, str], ...]:
    """A label map as sorted (key, value) pairs; non-string entries are dropped."""
    if not isinstance(data, Mapping):
        return ()
    return tuple(sorted((k, v) for k, v in data.items() if isinstance(k, str) and isinstance(v, str)))


@dataclass(frozen=True)
class PodList:
    """A LIST of the node's pods and the resourceVersion to watch from."""

    pods: tuple[PodView, ...]
    resource_version: str


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
class ObjectRef:
    """The object an Event is about, when it is not the agent's Node (a Pod: kind, namespace, name, uid)."""

    kind: str
    namespace: str
    name: str
    uid: str = ""


@dataclass(frozen=True)
class EventRecord:
    """A core/v1 Event about the Node (or `involved`); `name` is set once created, and `count` grows as repeats
    are folded in. The message is cut to `EVENT_MESSAGE_MAX` characters: text from outside (a device name, an
    annotation) can be any size, and an Event is for a person to read."""

    reason: str
    message: str
    type: str = "Normal"
    name: str = ""
    count: int = 1
    first_time: float = 0.0
    last_time: float = 0.0
    involved: ObjectRef | None = None

    def __post_init__(self) -> None:
        if len(self.message) > EVENT_MESSAGE_MAX:
            object.__setattr__(self, "message", cut(self.message, EVENT_MESSAGE_MAX))


#: events.k8s.io/v1 allows a note of at most 1 kB; core/v1 messages are kept to the same
EVENT_MESSAGE_MAX = 1024


@dataclass(frozen=True)
class WatchEvent(Generic[T]):
    """One line of a watch: ADDED / MODIFIED / DELETED with the object, or BOOKMARK with only a version."""

    type: str
    resource_version: str
    object: T | None = None


# --- server-side merge rules for what the agent writes -----------------------------------------------------------


def apply_patch(node: NodeView, patch: Mapping[str, Any]) -> NodeView:
    """A merge patch applied to a NodeView, for the fields remediation writes (dry-run and the simulation)."""
    meta = patch.get("metadata") or {}
    spec = patch.get("spec") or {}
    annotations = dict(node.annotations)
    for key, value in (meta.get("annotations") or {}).items():
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
    labels = dict(node.labels)
    for key, value in (meta.get("labels") or {}).items():
        if value is None:
            labels.pop(key, None)
        else:
            labels[key] = value
    changes: dict[str, Any] = {"annotations": annotations, "labels": labels}
    if "unschedulable" in spec:
        changes["unschedulable"] = bool(spec["unschedulable"])
    if "taints" in spec:
        changes["taints"] = tuple(Taint(t["key"], t["effect"], t.get("value", "")) for t in spec["taints"] or ())
    return dataclasses.replace(node, **changes)


def without_condition(node: NodeView, condition_type: str) -> NodeView:
    """The node without the condition of this type (a strategic merge `$patch: delete` on nodes/status)."""
    return dataclasses.replace(node, conditions={k: v for k, v in node.conditions.items() if k != condition_type})


def with_condition(node: NodeView, condition: Condition) -> NodeView:
    """The node with one condition replaced by type (what a strategic merge of nodes/status does)."""
    return dataclasses.replace(node, conditions={**node.conditions, condition.type: condition})
