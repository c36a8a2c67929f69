"""The in-process contracts between subsystems: one health vocabulary and one way to hand over a latest value.

Health publishes, consumers read; neither imports the other, both import this module (which imports nothing of
the agent):

- `Severity`: what a finding or the node deserves, an ordered enum (healthy < degraded < isolate < cordon <
  drain).
  Compare severities with each other, never with numbers; a new action slots in by its place in the class.
- `NodeVerdict`: the health subsystem's one conclusion about the node, the value remediation acts on.
- `GpuRecoveryAction`, `RecoveryRequest`: what the NVIDIA driver itself asks for a GPU (reset, reboot, drain),
  carried in the verdict so remediation can do exactly that.
- `DeviceHealthEvent`: one device going Unhealthy or back, as the device plugin reports it in ListAndWatch.
- `DeviceHealth`: the one copy of which devices are Unhealthy and why. Health writes it, the device plugin's
  servers read it, and its change log tells the device plugin which devices flipped.
- `GpuResetListener`: what remediation tells health about the GPU resets it runs (health implements it, and
  is given to remediation when it is built: health first, as data flows).
- `Latest[T]`: a typed latest-value cell (set / get / wait for a newer value). Only the latest node verdict
  matters, so a cell replaces queues, listener lists and drain-the-queue loops.
"""

from __future__ import annotations

import asyncio
import enum
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")

_CAMEL = re.compile(r"^[A-Z][A-Za-z0-9]*$")


class Severity(enum.Enum):
    """How bad a finding is, and what the node should have done to it; declaration order is severity order.

    The value is the word used in config, metrics, logs and the persisted state (`--link-down-action cordon`).
    """

    HEALTHY = "healthy"  # all clear; an Xid with this action is counted only ("none" in Xid overrides)
    DEGRADED = "degraded"  # report only: metric, condition, Event
    ISOLATE = "isolate"  # one device out of service: only the pods holding it are drained, the node stays open
    CORDON = "cordon"  # no new pods
    DRAIN = "drain"  # no new pods, and evict the ones there

    @property
    def rank(self) -> int:
        """Position in the order (0 for healthy); for sorting, not for comparing with literals."""
        return _RANK[self]

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank < other.rank

    def __le__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank <= other.rank

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank > other.rank

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Severity):
            return NotImplemented
        return self.rank >= other.rank

    @classmethod
    def parse(cls, text: str) -> Severity:
        """From its word, or an Xid action word ("none" is HEALTHY). ValueError names the accepted words."""
        word = text.strip().lower()
        if word == XID_NONE:
            return cls.HEALTHY
        try:
            return cls(word)
        except ValueError:
            raise ValueError(f"unknown action {text!r}; expected one of {', '.join(XID_ACTIONS)}") from None


_RANK: dict[Severity, int] = {severity: rank for rank, severity in enumerate(Severity)}

#: Every severity's word, in order: the choices of `--link-down-action` and the `node_verdict{verdict}` label.
VERDICTS: tuple[str, ...] = tuple(severity.value for severity in Severity)
#: Xid override actions: "none" counts the Xid only; the others are the severities above healthy.
XID_NONE = "none"
XID_ACTIONS: tuple[str, ...] = (XID_NONE, *VERDICTS[1:])


class GpuRecoveryAction(enum.Enum):
    """The recovery the NVIDIA driver requests for a GPU (NVML's `nvmlDeviceGpuRecoveryAction_t`, lower-cased).

    NVIDIA's meaning: `gpu_reset` stop the GPU's processes, reset it (`nvidia-smi -r`), restart them;
    `node_reboot` / `system_reboot` the OS state may be inconsistent, reboot; `drain_p2p` stop processes doing
    peer-to-peer and query again; `drain_and_reset` drain P2P, then reset the GPU; `bus_reset` reset the GPU's
    PCIe bus; `recover_imex_domain` recover the IMEX domain the GPU belongs to. `unknown`: a value newer than
    this agent.
    """

    NONE = "none"
    GPU_RESET = "gpu_reset"
    NODE_REBOOT = "node_reboot"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"
    RECOVER_IMEX_DOMAIN = "recover_imex_domain"
    BUS_RESET = "bus_reset"
    SYSTEM_REBOOT = "system_reboot"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class RecoveryRequest:
    """The driver asks for `action` on the GPU `gpu_uuid` (read from NVML's GPU recovery-action field)."""

    gpu_uuid: str
    action: GpuRecoveryAction


@dataclass(frozen=True)
class NodeVerdict:
    """What the health subsystem concluded about this node: the one value remediation acts on.

    `severity`: healthy (all clear), degraded (report only), cordon (stop new pods), drain (also evict pods).
    `reason`: CamelCase code of the first finding at that severity, e.g. "GpuXid79"; it becomes the taint value,
    condition reason and Event reason. `message`: one line for humans. `devices`: the device ids the findings at
    that severity name (GPU UUIDs, NIC bus ids). `hardware`: a hardware fault; by default the agent does not
    lift such a cordon by itself. `reasons`: every active finding's text, most severe first. `recovery`: every
    recovery the driver currently requests (whatever the severity), by GPU: what remediation should do.
    `reset_advised`: GPU UUIDs with an advisory a reset applies (a pending row remap): they stay in service, and
    with a reset command remediation resets them once idle.
    """

    severity: Severity
    reason: str = "GpuHealthy"
    message: str = ""
    devices: tuple[str, ...] = ()
    hardware: bool = False
    reasons: tuple[str, ...] = ()
    recovery: tuple[RecoveryRequest, ...] = ()
    reset_advised: tuple[str, ...] = ()  # GPUs a reset would do good while idle (a pending row remap): advisory

    def __post_init__(self) -> None:
        if not isinstance(self.severity, Severity):
            raise ValueError(f"verdict severity {self.severity!r} is not one of {', '.join(VERDICTS)}")
        if not _CAMEL.match(self.reason):
            raise ValueError(f"reason {self.reason!r} must be CamelCase letters and digits, e.g. GpuXid79")

    @property
    def verdict(self) -> str:
        """The severity's word (for logs and labels)."""
        return self.severity.value

    def describe(self) -> str:
        """One line for Events and logs: message plus the affected devices."""
        text = self.message or self.reason
        return f"{text} (devices: {', '.join(self.devices)})" if self.devices else text


HEALTHY = NodeVerdict(Severity.HEALTHY, "GpuHealthy", "all GPU and NIC checks pass")


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


@dataclass(frozen=True)
class DeviceHealthEvent:
    """A health verdict for one device ID (a VF bus id or a GPU UUID); `healthy` may be True again later."""

    device_id: str
    healthy: bool
    reason: str = ""


class GpuResetListener(Protocol):
    """Told by remediation about each GPU reset it runs, by the GPU's UUID: an advised reset `starting` (the GPU
    is Unhealthy while it runs), one `abandoned` before it ran (back in service), one `done` (the findings that
    wait for a reset end)."""

    def gpu_reset_starting(self, uuid: str) -> None: ...

    def gpu_reset_done(self, uuid: str) -> None: ...

    def gpu_reset_abandoned(self, uuid: str) -> None: ...


class NoResetListener:
    """Nobody to tell (remediation without health: its own tests, tools)."""

    def gpu_reset_starting(self, uuid: str) -> None:
        """Nothing to do."""

    def gpu_reset_done(self, uuid: str) -> None:
        """Nothing to do."""

    def gpu_reset_abandoned(self, uuid: str) -> None:
        """Nothing to do."""


class Latest(Generic[T]):
    """The latest value of something, with a version that grows on every change.

    `set` stores a value (an equal value is no change), `get` reads it (None before the first `set`), and
    `wait_newer(version)` returns once a value newer than `version` is there (at once if it already is), so a
    consumer that was busy sees the newest value and never a backlog. Use from the event loop's thread.
    """

    def __init__(self) -> None:
        self._value: T | None = None
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def version(self) -> int:
        """0 before the first value; grows by one on each change."""
        return self._version

    def get(self) -> T | None:
        """The latest value, None before the first."""
        return self._value

    def set(self, value: T) -> bool:
        """Store `value`; True when it differs from the latest one (waiters wake), False for a repeat."""
        if self._version and value == self._value:
            return False
        self._value = value
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    async def wait_newer(self, version: int) -> tuple[int, T]:
        """The first (version, value) with a version above `version`; waits until one is set."""
        while self._version <= version:
            await self._changed.wait()
        return self._version, self._value  # type: ignore[return-value]  # set at least once, so a T


class DeviceHealth:
    """Unhealthy device ID -> reason: the one owner of device health in the process.

    The health subsystem writes it (`replace` with everything the active findings name, or `apply` for one
    device); the device plugin reads it (`is_healthy`, `reason`) and waits on `wait_newer` to learn which
    devices flipped (`since`). Only a flip between Healthy and Unhealthy is an event: a new reason for a device
    that stays Unhealthy is recorded, but the kubelet's list would not change. A device need not be served (yet):
    its health applies when a rescan brings it. Use from the event loop's thread.
    """

    HISTORY = 4096  # flips kept for `since`; a consumer further behind re-reads everything

    def __init__(self) -> None:
        self._unhealthy: dict[str, str] = {}
        self._log: deque[tuple[int, DeviceHealthEvent]] = deque(maxlen=self.HISTORY)
        self._version = 0
        self._changed = asyncio.Event()

    @property
    def version(self) -> int:
        """Number of flips so far."""
        return self._version

    def is_healthy(self, device_id: str) -> bool:
        """False while some finding names the device."""
        return device_id not in self._unhealthy

    def reason(self, device_id: str) -> str | None:
        """Why the device is Unhealthy; None when it is Healthy."""
        return self._unhealthy.get(device_id)

    def unhealthy(self) -> dict[str, str]:
        """A copy: device ID -> reason for every Unhealthy device."""
        return dict(self._unhealthy)

    def apply(self, event: DeviceHealthEvent) -> bool:
        """Set one device's health; True when it flipped."""
        if event.healthy:
            if self._unhealthy.pop(event.device_id, None) is None:
                return False
        else:
            flipped = event.device_id not in self._unhealthy
            self._unhealthy[event.device_id] = event.reason
            if not flipped:
                return False
        self._record(event)
        return True

    def replace(self, unhealthy: Mapping[str, str]) -> list[DeviceHealthEvent]:
        """Make exactly these devices Unhealthy (with these reasons); the flips, in order."""
        flips = [DeviceHealthEvent(d, True) for d in sorted(self._unhealthy.keys() - unhealthy.keys())]
        flips += [DeviceHealthEvent(d, False, r) for d, r in sorted(unhealthy.items()) if d not in self._unhealthy]
        self._unhealthy = dict(unhealthy)
        for event in flips:
            self._record(event)
        return flips

    def since(self, version: int) -> list[DeviceHealthEvent] | None:
        """The flips after `version`, oldest first; None when some were dropped from the history."""
        if self._version - version > len(self._log):
            return None
        return [event for seq, event in self._log if seq > version]

    async def wait_newer(self, version: int) -> int:
        """Return the current version once it is above `version`."""
        while self._version <= version:
            await self._changed.wait()
        return self._version

    def _record(self, event: DeviceHealthEvent) -> None:
        self._version += 1
        self._log.append((self._version, event))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
