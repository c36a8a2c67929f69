"""The vocabulary every health producer shares: severities, findings, GPU identities and the node verdict.

Producers (kernel log, NVML events and polls, NIC links) describe what they saw as `Finding`s; the verdict
book (`agent.health.verdict`) turns the set of active findings into device health and one node verdict. Keeping
these small values in their own module lets producers and the book evolve without importing each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent import events
from agent.config.health import VERDICTS, XID_ACTIONS


class Severity(enum.IntEnum):
    """How bad a finding is; the node verdict is the worst active one."""

    HEALTHY = 0  # count only ("none" in Xid overrides)
    DEGRADED = 1  # metric/condition only
    CORDON = 2  # no new pods
    DRAIN = 3  # evict

    @property
    def verdict(self) -> str:
        """Node verdict name: healthy, degraded, cordon, drain."""
        return VERDICTS[self.value]

    @classmethod
    def parse(cls, text: str) -> Severity:
        """From a verdict name or an Xid action name ("none" is HEALTHY)."""
        text = text.strip().lower()
        if text in XID_ACTIONS:
            return cls(XID_ACTIONS.index(text))
        if text in VERDICTS:
            return cls(VERDICTS.index(text))
        raise ValueError(f"unknown action {text!r}; expected one of {', '.join(XID_ACTIONS)}")


class Clears(enum.Enum):
    """What ends a finding."""

    RESET = "reset"  # a GPU reset or reboot is observed (NVML answers again, volatile ECC zeroed, boot id)
    STATE = "state"  # the producer reports the condition gone (link up, remap no longer pending)
    HOLD = "hold"  # it expires a while after its last occurrence


@dataclass(frozen=True)
class GpuRef:
    """A GPU as the labels of metrics and logs know it; any part may be empty when a source cannot tell."""

    index: str = ""
    uuid: str = ""
    bus_id: str = ""  # canonical sysfs form 0000:1b:00.0, or the raw text of an unknown device

    @property
    def name(self) -> str:
        """Short human name for logs and reasons."""
        if self.index:
            return f"GPU {self.index} ({self.bus_id})"
        return f"GPU {self.uuid or self.bus_id or '?'}"


@dataclass(frozen=True)
class Finding:
    """One active problem. `key` identifies it (raising it again is a repeat, not a new problem)."""

    key: str
    severity: Severity
    reason: str
    clears: Clears
    devices: tuple[str, ...] = ()  # device IDs made Unhealthy while it lasts (GPU UUIDs, VF bus ids)
    gpu_uuid: str = ""  # the GPU whose reset clears a RESET finding
    expires_at: float | None = None  # HOLD findings: monotonic time
    code: str = "GpuFault"  # CamelCase kind for taints, conditions and Events, e.g. GpuXid79, NicLinkDown
    hardware: bool = False  # a hardware fault (remediation does not lift its cordon by itself)


@dataclass(frozen=True)
class NodeVerdict:
    """What the node should have done to it, and why.

    `reasons`: every active finding's text, most severe first. `reason`, `devices` and `hardware` describe the
    findings at the verdict's own severity: the CamelCase code of the first, the devices they name, and
    whether any is a hardware fault. `published()` is what leaves the health subsystem.
    """

    verdict: str
    reasons: tuple[str, ...] = ()
    reason: str = "GpuHealthy"
    devices: tuple[str, ...] = ()
    hardware: bool = False

    @property
    def severity(self) -> Severity:
        """The verdict as a Severity."""
        return Severity.parse(self.verdict)

    @property
    def message(self) -> str:
        """All reasons in one line."""
        return "; ".join(self.reasons) if self.reasons else "all GPU and NIC checks pass"

    def published(self) -> events.NodeVerdict:
        """The verdict as remediation receives it (`agent.events.NodeVerdict`)."""
        return events.NodeVerdict(self.verdict, self.reason, self.message, self.devices,  # type: ignore[arg-type]
                                  self.hardware)


HEALTHY = NodeVerdict("healthy")
