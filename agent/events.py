"""Messages that flow from producers to consumers, in a module neither side owns.

Health publishes `DeviceHealthEvent`s, which the device plugin consumes (ListAndWatch), and `NodeVerdict`s,
which remediation consumes (an asyncio queue; only the latest matters). Keeping the types here means health
never imports the device plugin (or grpc) or remediation, and neither of those imports health.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DeviceHealthEvent:
    """A health verdict for one device ID (a VF bus id or a GPU UUID); `healthy` may be True again later."""

    device_id: str
    healthy: bool
    reason: str = ""


Verdict = Literal["healthy", "degraded", "cordon", "drain"]

#: Severity order; the engine acts on the most severe of the health and maintenance verdicts.
SEVERITY: dict[str, int] = {"healthy": 0, "degraded": 1, "cordon": 2, "drain": 3}

_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


@dataclass(frozen=True)
class NodeVerdict:
    """What the health subsystem concluded about this node: the one value remediation acts on.

    `verdict`: healthy (all clear), degraded (report only), cordon (stop new pods), drain (also evict pods).
    `reason`: CamelCase, e.g. "GpuXid79"; it becomes the taint value, condition reason and Event reason.
    `devices`: the affected device ids (GPU UUIDs, NIC names), for messages.
    `hardware`: a hardware fault; by default the agent does not lift such a cordon by itself.
    """

    verdict: Verdict
    reason: str
    message: str = ""
    devices: tuple[str, ...] = ()
    hardware: bool = False

    def __post_init__(self) -> None:
        if self.verdict not in SEVERITY:
            raise ValueError(f"verdict {self.verdict!r} is not one of {', '.join(SEVERITY)}")
        if not _CAMEL.match(self.reason):
            raise ValueError(f"reason {self.reason!r} must be CamelCase letters and digits, e.g. GpuXid79")

    @property
    def severity(self) -> int:
        """0 healthy .. 3 drain."""
        return SEVERITY[self.verdict]

    def describe(self) -> str:
        """One line for Events and logs: message plus the affected devices."""
        text = self.message or self.reason
        return f"{text} (devices: {', '.join(self.devices)})" if self.devices else text


HEALTHY = NodeVerdict("healthy", "GpuHealthy", "all GPU and NIC checks pass")


def worst(*verdicts: NodeVerdict | None) -> NodeVerdict | None:
    """The most severe verdict; the first one wins a tie. None when none is known yet."""
    known = [v for v in verdicts if v is not None]
    if not known:
        return None
    best = known[0]
    for verdict in known[1:]:
        if verdict.severity > best.severity:
            best = verdict
    return best
