"""The needs-a-human latch: a node remediated too often stops bouncing back and waits for a person.

Every remediation (a cordon; later a GPU reset or a reboot request) is stamped into the node annotation
`<prefix>/remediation-history` (RFC 3339 times within the window, comma-separated), so the count survives agent
restarts and reinstalls. The `latchCount`-th remediation within `latchWindowSeconds` sets
`<prefix>/needs-human-attention`: the node then stays cordoned with reason `NeedsHumanAttention`, the agent never
lifts that cordon by itself, and only a person clears it by removing that annotation (after the repair). Peers:
NVSentinel's `MultipleRemediations` (5 in 7 days, removed by hand), gpud's reboot threshold (2 in 3 days).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.kube.model import NodeView, format_time, parse_time

LATCH_REASON = "NeedsHumanAttention"


@dataclass(frozen=True)
class LatchKeys:
    """The latch's annotation names under the configured prefix."""

    latched: str
    history: str

    @classmethod
    def for_prefix(cls, prefix: str) -> LatchKeys:
        """`<prefix>/needs-human-attention`, `<prefix>/remediation-history`."""
        return cls(latched=f"{prefix}/needs-human-attention", history=f"{prefix}/remediation-history")


def history(node: NodeView, keys: LatchKeys) -> list[float]:
    """The recorded remediation times (unparseable entries are dropped: a person may have edited them)."""
    times = (parse_time(part.strip()) for part in node.annotations.get(keys.history, "").split(","))
    return sorted(t for t in times if t is not None)


def latched(node: NodeView, keys: LatchKeys) -> bool:
    """The latch annotation is present (whatever its value: the person clears it by removing it)."""
    return keys.latched in node.annotations


@dataclass(frozen=True)
class Remediation:
    """One more remediation: the annotations to write and whether it trips the latch."""

    annotations: dict[str, str | None]
    trips: bool
    count: int
    message: str


def record(node: NodeView, keys: LatchKeys, now: float, *, count: int, window: float, what: str) -> Remediation:
    """Stamp a remediation at `now`, keeping only those within the window; trip at `count` (0: latch off)."""
    recent = [t for t in history(node, keys) if t > now - window] + [now]
    annotations: dict[str, str | None] = {keys.history: ",".join(format_time(t) for t in recent)}
    trips = count > 0 and len(recent) >= count and not latched(node, keys)
    message = (f"{len(recent)} remediations within {window / 86400:g} days (the last: {what}), from "
               f"{format_time(recent[0])}; the node stays cordoned until a person removes the annotation "
               f"{keys.latched}")
    if trips:
        annotations[keys.latched] = f"{len(recent)} remediations since {format_time(recent[0])}, latched at " \
                                    f"{format_time(now)}"
    return Remediation(annotations, trips, len(recent), message)


def clear_patch(keys: LatchKeys, override_key: str, override_reason: str) -> dict[str, Any]:
    """After a person removed the latch: forget the history (it would trip again at once) and an admin override
    recorded for the latch itself."""
    annotations: dict[str, str | None] = {keys.history: None}
    if override_reason == LATCH_REASON:
        annotations[override_key] = None
    return {"metadata": {"annotations": annotations}}
