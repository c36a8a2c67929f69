"""The values every health producer shares: findings and GPU identities (severities are `agent.signals`').

Producers (kernel log, NVML events and polls, NIC links) describe what they saw as `Finding`s; the verdict
book (`agent.health.verdict`) turns the set of active findings into device health and one node verdict
(`agent.signals.NodeVerdict`). Keeping these small values in their own module lets producers and the book
evolve without importing each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from agent.signals import GpuRecoveryAction, Severity


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


# Codes of findings that say a check could not look (its source failed), not that a device is faulty: node labels
# keep a device's last known health while only these name it
UNKNOWN_CODES = frozenset({"GpuHealthUnknown", "NicHealthUnknown"})


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
    recovery: GpuRecoveryAction | None = None  # the driver's own requested recovery for `gpu_uuid`, if it said one
