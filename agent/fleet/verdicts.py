"""A node's state as the agent left it on the Node, read back by an operator: verdict, cordon, latch, GPUs, incidents.

The agent's condition does not say which severity its verdict had, so the fleet view rebuilds it from what the
agent writes (agent/remediation: state, isolate, latch, incidents). The first rule that applies:

- no condition of the configured type, or a status other than True/False -> `unknown`;
- False with a non-empty `<prefix>/isolated-devices` -> `isolate`;
- False -> `healthy`;
- True with the agent's cordon intact (`cordon-by` set, `spec.unschedulable`, the `<prefix>/gpu-unhealthy` taint)
  and `<prefix>/drain` present -> `drain`;
- True with the cordon intact, or True with a message starting `RemediationDeferred` -> `cordon`;
- otherwise -> `degraded`.

Latched: `<prefix>/needs-human-attention` present. GPUs: the labels `<prefix>/gpu.expected` and `<prefix>/gpu.healthy`,
each counted only when it is a non-negative integer. A repeat offender has at least N incident stamps inside its
incidents annotation's window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from agent.kube.nodelist import NodeCondition, NodeSummary
from agent.remediation import incidents
from agent.remediation.isolate import IsolationKeys
from agent.remediation.latch import LatchKeys
from agent.remediation.state import DEFERRED, Keys

VERDICTS = ("healthy", "degraded", "isolate", "cordon", "drain", "unknown")
_COUNT = re.compile(r"[0-9]{1,18}")  # a label value is at most 63 characters; a GPU count is far below 10**18


@dataclass(frozen=True)
class FleetKeys:
    """The names the view reads, under the agent's prefix."""

    condition_type: str
    state: Keys
    isolated: str
    latched: str
    incidents: str
    gpus_expected: str
    gpus_healthy: str

    @classmethod
    def of(cls, condition_type: str, prefix: str) -> FleetKeys:
        """The agent's names for this condition type and prefix."""
        return cls(condition_type, Keys.for_prefix(prefix), IsolationKeys.for_prefix(prefix).devices,
                   LatchKeys.for_prefix(prefix).latched, incidents.annotation_key(prefix),
                   f"{prefix}/gpu.expected", f"{prefix}/gpu.healthy")


@dataclass(frozen=True)
class NodeState:
    """One node's verdict and what it came from."""

    name: str
    verdict: str
    condition: dict[str, str] | None
    cordoned: bool
    drain: str | None
    isolated_devices: str
    latched: bool
    gpus_expected: int | None
    gpus_healthy: int | None
    incidents: incidents.Incidents | None
    recent_incidents: int
    repeat_offender: bool

    def to_json(self) -> dict[str, Any]:
        """The `nodes[]` entry of `fleet --json`."""
        inc = self.incidents
        return {"name": self.name, "verdict": self.verdict, "repeatOffender": self.repeat_offender,
                "condition": self.condition, "cordoned": self.cordoned, "drain": self.drain,
                "isolatedDevices": self.isolated_devices, "latched": self.latched,
                "gpus": {"expected": self.gpus_expected, "healthy": self.gpus_healthy},
                "incidents": None if inc is None else {"count": inc.count, "lastCause": inc.last_cause,
                                                       "inWindow": self.recent_incidents,
                                                       "windowSeconds": int(inc.window_seconds)}}


def gpu_count(value: str | None) -> int | None:
    """A label's GPU count when it is a non-negative integer, else None (not counted)."""
    return int(value) if value is not None and _COUNT.fullmatch(value) else None


def cordon_intact(node: NodeSummary, keys: FleetKeys) -> bool:
    """The agent owns a cordon and nobody lifted it: `cordon-by`, `spec.unschedulable` and its taint all there."""
    return bool(node.annotations.get(keys.state.cordon_by)) and node.unschedulable \
        and node.has_taint(keys.state.taint)


def verdict_of(node: NodeSummary, keys: FleetKeys, condition: NodeCondition | None) -> str:
    """The first rule of the module docstring that applies (`condition`: the node's of the configured type)."""
    if condition is None or condition.status not in ("True", "False"):
        return "unknown"
    if condition.status == "False":
        return "isolate" if node.annotations.get(keys.isolated, "").strip() else "healthy"
    intact = cordon_intact(node, keys)
    if intact and keys.state.drain in node.annotations:
        return "drain"
    if intact or condition.message.startswith(DEFERRED):
        return "cordon"
    return "degraded"


def node_state(node: NodeSummary, keys: FleetKeys, now: float, repeat: int) -> NodeState:
    """Everything the view says about one node."""
    condition = node.condition(keys.condition_type)
    recorded = incidents.parse(node.annotations.get(keys.incidents))
    inside = len(recorded.inside(now)) if recorded is not None else 0
    return NodeState(
        name=node.name, verdict=verdict_of(node, keys, condition),
        condition=None if condition is None else {"status": condition.status, "reason": condition.reason,
                                                  "message": condition.message},
        cordoned=cordon_intact(node, keys), drain=node.annotations.get(keys.state.drain),
        isolated_devices=node.annotations.get(keys.isolated, ""), latched=keys.latched in node.annotations,
        gpus_expected=gpu_count(node.labels.get(keys.gpus_expected)),
        gpus_healthy=gpu_count(node.labels.get(keys.gpus_healthy)),
        incidents=recorded, recent_incidents=inside,
        repeat_offender=recorded is not None and recorded.repeat_offender(now, repeat))


@dataclass
class Summary:
    """The fleet's totals."""

    nodes: int = 0
    verdicts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VERDICTS, 0))
    cordoned: int = 0
    latched: int = 0
    gpus_expected: int = 0
    gpus_healthy: int = 0
    repeat_offenders: list[str] = field(default_factory=list)

    def add(self, state: NodeState) -> None:
        """Count one node."""
        self.nodes += 1
        self.verdicts[state.verdict] += 1
        self.cordoned += state.cordoned
        self.latched += state.latched
        self.gpus_expected += state.gpus_expected or 0
        self.gpus_healthy += state.gpus_healthy or 0
        if state.repeat_offender:
            self.repeat_offenders.append(state.name)

    def to_json(self) -> dict[str, Any]:
        """The `summary` object of `fleet --json`; `repeatOffenders` names the nodes, sorted."""
        return {"nodes": self.nodes, "verdicts": dict(self.verdicts), "cordoned": self.cordoned,
                "latched": self.latched, "gpus": {"expected": self.gpus_expected, "healthy": self.gpus_healthy},
                "repeatOffenders": sorted(self.repeat_offenders)}
