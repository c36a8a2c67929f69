"""Remediation state lives on the Node as annotations, so a restarted agent continues instead of repeating.

`Keys` names the taint and annotations under the configured prefix; `Recorded` reads them back. The patch
builders return JSON merge patches computed from the node as last seen; the caller sends them guarded by that
node's resourceVersion, so a concurrent writer (an admin, another controller) yields 409 and a recompute
instead of a lost update of `spec.taints`, which a merge patch replaces as a whole.

Annotations (prefix `P`): `P/cordon-by` (ownership; present only while the agent owns a cordon),
`P/cordon-reason`, `P/cordon-timestamp`, `P/cordon-hardware`, `P/cordon-unschedulable` (the agent set
`spec.unschedulable`, so it may unset it), `P/drain` + `P/drain-started`, `P/healthy-since`, and
`P/admin-uncordoned` (the reason whose cordon an admin lifted; the agent will not re-cordon for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.kube.model import NodeView, Taint, format_time, parse_time

OWNER = "gpu-node-agent"
# the Event, and the start of the condition message, while a cordon waits for a free slot (read back by `fleet`)
DEFERRED = "RemediationDeferred"


@dataclass(frozen=True)
class Keys:
    """Taint and annotation names under one prefix; build with `Keys.for_prefix`."""

    taint: str
    cordon_by: str
    cordon_reason: str
    cordon_time: str
    cordon_hardware: str
    cordon_unschedulable: str
    drain: str
    drain_started: str
    healthy_since: str
    override: str

    @classmethod
    def for_prefix(cls, prefix: str) -> Keys:
        """`<prefix>/gpu-unhealthy`, `<prefix>/cordon-by`, ..."""
        return cls(taint=f"{prefix}/gpu-unhealthy", cordon_by=f"{prefix}/cordon-by",
                   cordon_reason=f"{prefix}/cordon-reason", cordon_time=f"{prefix}/cordon-timestamp",
                   cordon_hardware=f"{prefix}/cordon-hardware", cordon_unschedulable=f"{prefix}/cordon-unschedulable",
                   drain=f"{prefix}/drain", drain_started=f"{prefix}/drain-started",
                   healthy_since=f"{prefix}/healthy-since", override=f"{prefix}/admin-uncordoned")


_CORDON = ("cordon_by", "cordon_reason", "cordon_time", "cordon_hardware", "cordon_unschedulable",
           "drain", "drain_started", "healthy_since")


@dataclass(frozen=True)
class Recorded:
    """The agent's decisions as recorded on the node."""

    owner: str = ""
    reason: str = ""
    since: float | None = None
    hardware: bool = False
    set_unschedulable: bool = False
    drain: str = ""  # "", running, complete, deadline
    drain_started: float | None = None
    healthy_since: float | None = None
    override_reason: str = ""

    @property
    def cordoned(self) -> bool:
        """The agent owns a cordon on this node."""
        return bool(self.owner)

    @classmethod
    def from_node(cls, node: NodeView, keys: Keys) -> Recorded:
        """Read the annotations."""
        a = node.annotations
        return cls(owner=a.get(keys.cordon_by, ""), reason=a.get(keys.cordon_reason, ""),
                   since=parse_time(a.get(keys.cordon_time)), hardware=a.get(keys.cordon_hardware) == "true",
                   set_unschedulable=a.get(keys.cordon_unschedulable) == "true", drain=a.get(keys.drain, ""),
                   drain_started=parse_time(a.get(keys.drain_started)),
                   healthy_since=parse_time(a.get(keys.healthy_since)), override_reason=a.get(keys.override, ""))


def _taints_without(node: NodeView, key: str) -> list[dict[str, str]]:
    return [t.to_dict() for t in node.taints if t.key != key]


def cordon_patch(node: NodeView, keys: Keys, reason: str, hardware: bool, now: float) -> dict[str, Any]:
    """Cordon, our NoSchedule taint with the reason, and ownership annotations, in one patch."""
    taints = [*_taints_without(node, keys.taint), Taint(keys.taint, "NoSchedule", reason).to_dict()]
    annotations = {keys.cordon_by: OWNER, keys.cordon_reason: reason, keys.cordon_time: format_time(now),
                   keys.cordon_hardware: "true" if hardware else "false",
                   keys.cordon_unschedulable: "false" if node.unschedulable else "true",
                   keys.override: None, keys.healthy_since: None}
    return {"spec": {"unschedulable": True, "taints": taints}, "metadata": {"annotations": annotations}}


def reason_patch(node: NodeView, keys: Keys, reason: str, hardware: bool) -> dict[str, Any]:
    """A new fault on a node we already cordoned: new taint value and reason; hardware is sticky."""
    taints = [*_taints_without(node, keys.taint), Taint(keys.taint, "NoSchedule", reason).to_dict()]
    recorded = Recorded.from_node(node, keys)
    return {"spec": {"taints": taints}, "metadata": {"annotations": {
        keys.cordon_reason: reason, keys.cordon_hardware: "true" if hardware or recorded.hardware else "false"}}}


def uncordon_patch(node: NodeView, keys: Keys) -> dict[str, Any]:
    """Lift only what we own: our taint, `spec.unschedulable` if we set it, our annotations."""
    spec: dict[str, Any] = {"taints": _taints_without(node, keys.taint)}
    if Recorded.from_node(node, keys).set_unschedulable and node.unschedulable:
        spec["unschedulable"] = False
    return {"spec": spec, "metadata": {"annotations": dict.fromkeys(getattr(keys, k) for k in _CORDON)}}


def admin_override_patch(node: NodeView, keys: Keys, reason: str) -> dict[str, Any]:
    """An admin uncordoned our cordon: finish their intent (drop our taint), forget ownership, remember why."""
    annotations: dict[str, Any] = dict.fromkeys(getattr(keys, k) for k in _CORDON)
    annotations[keys.override] = reason
    return {"spec": {"taints": _taints_without(node, keys.taint)}, "metadata": {"annotations": annotations}}


def annotate(values: Mapping[str, str | None]) -> dict[str, Any]:
    """Set (or, with None, remove) annotations."""
    return {"metadata": {"annotations": dict(values)}}


def remove_taint_patch(node: NodeView, key: str) -> dict[str, Any] | None:
    """Drop every taint with this key; None when there is none."""
    if node.taint(key) is None:
        return None
    return {"spec": {"taints": _taints_without(node, key)}}


def compose(first: Mapping[str, Any], second: Mapping[str, Any]) -> dict[str, Any]:
    """One merge patch equivalent to applying `first` then `second` (None stays a delete marker)."""
    out = dict(first)
    for key, value in second.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = compose(out[key], value)
        else:
            out[key] = value
    return out
