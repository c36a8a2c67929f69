"""The verdict book: active findings in, device health and one node verdict out.

A pure, synchronous value (no I/O, no clock of its own) so every rule is testable on plain data:

- a device is Unhealthy while any active finding names it, Healthy again when the last one ends;
- the node verdict is the worst active severity (healthy < degraded < isolate < cordon < drain), with the
  reasons at that severity first;
- `isolate` holds for one device only: isolate findings on two devices (or one that names no device) make the
  node verdict a drain, reason `MultipleDevicesIsolated` — a node losing several GPUs is a node fault, and the
  device plugin alone no longer keeps jobs whole on it;
- findings end by their own rule: RESET ones when the GPU's reset (or a reboot) is observed, STATE ones when
  the producer says the condition is gone, HOLD ones a while after their last occurrence.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from agent.health.findings import UNKNOWN_CODES, Clears, Finding
from agent.signals import HEALTHY, GpuRecoveryAction, NodeVerdict, RecoveryRequest, Severity

RESET_RECOVERY = frozenset({GpuRecoveryAction.GPU_RESET, GpuRecoveryAction.DRAIN_AND_RESET})


class VerdictBook:
    """The set of active findings, keyed by `Finding.key`."""

    def __init__(self, findings: Iterable[Finding] = ()) -> None:
        self._findings: dict[str, Finding] = {f.key: f for f in findings}

    def __contains__(self, key: str) -> bool:
        return key in self._findings

    def __len__(self) -> int:
        return len(self._findings)

    def findings(self) -> list[Finding]:
        """Active findings, most severe first."""
        return sorted(self._findings.values(), key=lambda f: (-f.severity.rank, f.key))

    def get(self, key: str) -> Finding | None:
        """The active finding with this key."""
        return self._findings.get(key)

    def add(self, finding: Finding) -> bool:
        """Raise a finding; a repeat only extends a HOLD expiry. True when something visible changed."""
        old = self._findings.get(finding.key)
        if old is not None and (old.severity, old.devices, old.reason) == (finding.severity, finding.devices,
                                                                          finding.reason):
            if finding.expires_at is not None and (old.expires_at or 0) < finding.expires_at:
                self._findings[finding.key] = replace(old, expires_at=finding.expires_at)
            return False
        if old is not None and old.clears is Clears.RESET and old.severity >= finding.severity:
            return False  # a repeat (another source, milder) keeps the first report of a fault awaiting reset
        self._findings[finding.key] = finding
        return True

    def remove(self, key: str) -> Finding | None:
        """End one finding (STATE findings when their condition is gone); the removed finding or None."""
        return self._findings.pop(key, None)

    def remove_where(self, prefix: str) -> list[Finding]:
        """End every finding whose key starts with `prefix`."""
        return [self._findings.pop(k) for k in [k for k in self._findings if k.startswith(prefix)]]

    def gpu_reset(self, gpu_uuid: str) -> list[Finding]:
        """A reset of this GPU was observed: its RESET findings end."""
        gone = [k for k, f in self._findings.items() if f.clears is Clears.RESET and f.gpu_uuid == gpu_uuid]
        return [self._findings.pop(k) for k in gone]

    def expire(self, now: float) -> list[Finding]:
        """HOLD findings whose time is up end."""
        gone = [k for k, f in self._findings.items()
                if f.clears is Clears.HOLD and f.expires_at is not None and f.expires_at <= now]
        return [self._findings.pop(k) for k in gone]

    def awaiting_reset(self) -> list[Finding]:
        """Findings that only a reset or reboot ends (what must survive an agent restart)."""
        return [f for f in self.findings() if f.clears is Clears.RESET]

    def unhealthy_devices(self) -> dict[str, str]:
        """Device ID -> reason, for every device some active finding names."""
        reasons: dict[str, list[str]] = {}
        for finding in self.findings():
            for device in finding.devices:
                reasons.setdefault(device, []).append(finding.reason)
        return {device: "; ".join(texts) for device, texts in sorted(reasons.items())}

    def unknown_devices(self) -> frozenset[str]:
        """Devices every active finding about which says only that a check could not look (`UNKNOWN_CODES`)."""
        named: dict[str, bool] = {}
        for finding in self.findings():
            for device in finding.devices:
                named[device] = named.get(device, True) and finding.code in UNKNOWN_CODES
        return frozenset(device for device, unknown in named.items() if unknown)

    def reset_advised(self) -> tuple[str, ...]:
        """GPUs with an advisory that a reset applies (a pending row remap): findings that make nothing
        Unhealthy and carry a GPU reset as recovery."""
        return tuple(sorted({f.gpu_uuid for f in self._findings.values()
                             if f.severity is Severity.HEALTHY and f.gpu_uuid and f.recovery in RESET_RECOVERY}))

    def reset_pending(self) -> frozenset[str]:
        """GPUs that wait for a reset: advised, or named by an active finding whose recovery is a reset."""
        return frozenset(f.gpu_uuid for f in self._findings.values() if f.gpu_uuid and f.recovery in RESET_RECOVERY)

    def verdict(self) -> NodeVerdict:
        """The worst active severity and the reasons for it, most severe first."""
        active = [f for f in self.findings() if f.severity > Severity.HEALTHY]
        advised = self.reset_advised()
        if not active:
            return replace(HEALTHY, reset_advised=advised) if advised else HEALTHY
        top = [f for f in active if f.severity == active[0].severity]
        reasons = tuple(dict.fromkeys(f.reason for f in active))
        recovery = tuple(sorted({RecoveryRequest(f.gpu_uuid, f.recovery) for f in active
                                 if f.recovery is not None and f.gpu_uuid},
                                key=lambda r: (r.gpu_uuid, r.action.value)))
        severity, code = active[0].severity, top[0].code
        units = {isolated_unit(f) for f in top}
        if severity is Severity.ISOLATE and (len(units) != 1 or None in units):
            severity, code = Severity.DRAIN, ESCALATED
        return NodeVerdict(severity, code, "; ".join(reasons),
                           tuple(dict.fromkeys(d for f in top for d in f.devices)), any(f.hardware for f in top),
                           reasons, recovery, advised)


#: The verdict reason when isolate findings name more than one device.
ESCALATED = "MultipleDevicesIsolated"


def isolated_unit(finding: Finding) -> str | None:
    """The one device an isolate finding takes out: its GPU, else the first device it names (a NIC's PF);
    None for a finding that names no device: it cannot be contained to one."""
    return finding.gpu_uuid or (finding.devices[0] if finding.devices else None)
