"""Turn what the producers observe into findings: the health rules, and nothing else.

Producers call `HealthAssessor.on_*` from the event loop thread (NVML's blocking thread hands its events over
with `call_soon_threadsafe`), so nothing here needs a lock. The parts it uses each have one job: `GpuNames`
(a GPU by any source's name), `VerdictBook` (the active findings), `StateReporters` (which sources report a
STATE finding) and `HealthPublisher` (device health and the node verdict out, after every observation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.config.health import HealthConfig
from agent.health.findings import Clears, Finding, GpuRef
from agent.health.names import GpuNames
from agent.health.publish import HealthPublisher
from agent.health.reporters import StateReporters
from agent.health.verdict import VerdictBook
from agent.health.xid import RESET_ADVISED_XIDS, XidCounter, XidPolicy
from agent.host.nvml import MemoryHealth, NvmlEvent
from agent.signals import DeviceHealth, GpuRecoveryAction, Latest, NodeVerdict, Severity
from agent.topology.model import MigDevice, Nic, Topology

log = logging.getLogger(__name__)

_LOST_XID = 79
_RECOVERY_ACTION_XID = 154  # GPU_RECOVERY_ACTION_CHANGED: NVML's recovery-action field has a new value
_PAIR_WINDOW = 5.0  # kernel log and NVML report one Xid within milliseconds of each other

# Findings any source can raise about a GPU's memory, so one fault seen by NVML and DCGM is one finding.
_ECC = {"sbe": ("GpuEccSbe", "single-bit ECC errors"), "dbe": ("GpuEccDbe", "uncorrectable ECC errors")}
_MEMORY_FLAGS = {  # MemoryHealth attribute -> (key, code, hardware, text, severity) while the flag lasts
    # A pending remap or retirement is an advisory: the GPU keeps working and takes new work (NVIDIA's memory-error
    # guide); a reset applies it. Only a failed remap (the spare rows are used up) is a fault: the node cordons.
    "remap_pending": ("remap-pending", "GpuRowRemapPending", False, "row remap pending (reset the GPU when idle)",
                      Severity.HEALTHY),
    "remap_failure": ("remap-failure", "GpuRowRemapFailure", True, "row remapping failed", Severity.CORDON),
    "retired_pages_pending": ("retire-pending", "GpuPageRetirementPending", False,
                              "page retirement pending (reset the GPU when idle)", Severity.HEALTHY),
}
_LINK_ERRORS = {"nvlink": ("GpuNvlinkErrors", "NVLink errors growing"),
                "pcie_replay": ("GpuPcieReplays", "PCIe replays growing")}


@dataclass(frozen=True)
class LinkStatus:
    """The last link check of one RDMA NIC (physical function)."""

    nic: Nic
    up: bool
    detail: str = ""


class HealthAssessor:
    """The health rules: observations in, findings into the book; the publisher sends what changed."""

    def __init__(self, config: HealthConfig, topology: Topology, device_health: DeviceHealth,
                 clock: Callable[[], float], *, verdicts: Latest[NodeVerdict] | None = None,
                 findings_listener: Callable[[Sequence[Finding]], None] | None = None) -> None:
        self.config = config
        self.clock = clock
        self.policy = XidPolicy(config.xid_action_overrides())
        # DCGM reports an Xid a scrape or an exporter sample later than the kernel log: pair over that lag.
        pair_window = max(_PAIR_WINDOW, config.dcgm_xid_pairing_window_seconds) if config.dcgm_exporter_url \
            else _PAIR_WINDOW
        self.xids = XidCounter(config.xid_burst_window_seconds, pair_window)
        self.book = VerdictBook()
        self.names = GpuNames(topology)
        self.publisher = HealthPublisher(device_health, verdicts if verdicts is not None else Latest(),
                                         lambda: self.names.topology, findings_listener)
        self.memory: dict[str, MemoryHealth] = {}  # latest poll per GPU UUID
        self.links: dict[str, LinkStatus] = {}  # by PF bus id
        self.awaiting_reset_changed = False  # persist the RESET findings when set
        self._nvml_lost: set[str] = set()
        self._reporters = StateReporters()
        self.recovery_action_changed: Callable[[], None] | None = None  # told on Xid 154 (read the field now)

    @property
    def topology(self) -> Topology:
        """The topology GPUs and NICs are named from."""
        return self.names.topology

    @property
    def verdict(self) -> NodeVerdict:
        """The node verdict as of the last observation (published once the first pass is done)."""
        return self.publisher.current

    def update_topology(self, topology: Topology) -> None:
        """Use a rescanned topology for names and device IDs from now on; vanished NICs are forgotten."""
        self.names.update(topology)
        present = {nic.bus_id for nic in topology.nics}
        for bus_id in [b for b in self.links if b not in present]:
            del self.links[bus_id]
            self.book.remove(f"link:{bus_id}")
            self._reporters.forget(f"link:{bus_id}")
        self._publish()

    # observations --------------------------------------------------------------------------------------------
    def on_xid(self, gpu: GpuRef, code: int, source: str, detail: str = "", *,
               gpu_instance: int | None = None, count: int = 1) -> None:
        """`count` Xids from the kernel log ("kmsg"), NVML ("nvml") or DCGM ("dcgm")."""
        if code == _RECOVERY_ACTION_XID and self.recovery_action_changed is not None:
            self.recovery_action_changed()  # every report, repeats too: each may carry a new action
        now = self.clock()
        record = self.xids.record(gpu, code, source, now, count)
        if not record.counted:
            return
        action = self.policy.action(code)
        if record.first_of_burst:
            where = gpu.name + (f" GPU-I {gpu_instance}" if gpu_instance is not None else "")
            log.log(logging.WARNING if action > Severity.HEALTHY else logging.INFO, "%s on %s from %s: %s -> %s",
                    self.policy.describe(code), where, source, detail or "-",
                    action.value if action > Severity.HEALTHY else "counted only",
                    extra={"gpu_uuid": gpu.uuid, "xid": code, "action": action.value})
        if action == Severity.HEALTHY:
            if code in RESET_ADVISED_XIDS and gpu.uuid:  # applied by the next reset: advised until one is seen
                self._add(Finding(f"xid:{code}:{gpu.uuid}", Severity.HEALTHY,
                                  f"{self.policy.describe(code)} on {gpu.name}: a reset applies it", Clears.RESET,
                                  gpu_uuid=gpu.uuid, code=f"GpuXid{code}", recovery=GpuRecoveryAction.GPU_RESET))
                self._publish()
            return
        describe, kind, hardware = self.policy.describe(code), f"GpuXid{code}", self.policy.is_hardware(code)
        key, reason = f"xid:{code}:{gpu.uuid or gpu.bus_id}", f"{describe} on {gpu.name}"
        if code == _LOST_XID:
            self._add(self._lost_finding(gpu, f"{gpu.name} fell off the bus: {describe}", action, kind))
        elif action >= Severity.ISOLATE:  # the device stays out until a reset (or reboot) is observed
            devices = (gpu.uuid,) if gpu.uuid else ()
            if (mig := self._mig_target(gpu, code, gpu_instance)) is not None:  # that MIG device only
                key, reason, devices = f"{key}:gi{mig.gpu_instance}", f"{reason} MIG {mig.profile} " \
                    f"GPU-I {mig.gpu_instance}", (mig.uuid,)
            self._add(Finding(key, action, reason, Clears.RESET, devices, gpu.uuid,
                              code=kind, hardware=hardware, recovery=self.policy.recovery(code)))
        else:
            self._add(self._hold(key, action, reason, kind, hardware))
        self._publish()

    def on_gpu_lost(self, gpu: GpuRef, why: str, *, from_nvml: bool) -> None:
        """The GPU stopped answering NVML (GPU_IS_LOST), or the kernel log says it fell off the bus."""
        if from_nvml and gpu.uuid:
            self._nvml_lost.add(gpu.uuid)  # NVML answering again later is the reset we wait for
        self._add(self._lost_finding(gpu, f"{gpu.name} is lost: {why}", Severity.DRAIN, "GpuLost"))
        self._publish()

    def on_gpu_answering(self, uuid: str) -> None:
        """NVML answered for this GPU; if it had been lost, that is a reset (or re-attach) observed."""
        if uuid in self._nvml_lost:
            self._nvml_lost.discard(uuid)
            self.on_gpu_reset(uuid, "NVML answers again")

    def on_gpu_reset(self, uuid: str, why: str) -> None:
        """A reset of this GPU was observed: findings that waited for it end, ECC baselines restart."""
        cleared = self.book.gpu_reset(uuid)
        self.memory.pop(uuid, None)
        if cleared:
            log.info("%s reset observed (%s); cleared: %s", self.names.by_uuid(uuid).name, why,
                     "; ".join(f.reason for f in cleared), extra={"gpu_uuid": uuid})
            self.awaiting_reset_changed = True
        self._publish()

    def on_gpu_resetting(self, uuid: str) -> None:
        """Remediation starts an advised reset of this idle GPU: Unhealthy until the reset is observed (a finding
        at no severity: the node verdict does not change)."""
        self._add(Finding(f"resetting:{uuid}", Severity.HEALTHY, f"{self.names.by_uuid(uuid).name}: being reset",
                          Clears.RESET, (uuid,), uuid, code="GpuResetting"))
        self._publish()

    def on_gpu_reset_abandoned(self, uuid: str) -> None:
        """The advised reset did not start after all (a pod took the GPU): back in service."""
        if self.book.remove(f"resetting:{uuid}") is not None:
            self.awaiting_reset_changed = True
        self._publish()

    def on_nvml_event(self, event: NvmlEvent) -> None:
        """An event from the NVML event set (delivered on the loop thread)."""
        gpu = self.names.by_uuid(event.uuid)
        if event.kind == "xid":
            self.on_xid(gpu, event.xid, "nvml", gpu_instance=event.gpu_instance)
        elif event.kind == "lost":
            self.on_gpu_lost(gpu, "NVML: GPU is lost", from_nvml=True)
        elif event.kind in _ECC:
            self.on_ecc_growth(gpu, event.kind)

    def on_memory(self, health: MemoryHealth) -> None:
        """One NVML poll: ECC deltas, retired-page and row-remap flags."""
        uuid, gpu = health.uuid, self.names.by_uuid(health.uuid)
        self.on_gpu_answering(uuid)
        before = self.memory.get(uuid)
        if before is not None and _dropped(before, health):
            self.on_gpu_reset(uuid, "volatile ECC counts were zeroed")
            before = None
        self.memory[uuid] = health
        if before is not None:
            for kind, old, new in (("sbe", before.ecc_corrected_volatile, health.ecc_corrected_volatile),
                                   ("dbe", before.ecc_uncorrected_volatile, health.ecc_uncorrected_volatile)):
                if old is not None and new is not None and new > old:
                    log.info("%s: %s growing (+%d)", gpu.name, _ECC[kind][1], new - old, extra={"gpu_uuid": uuid})
                    self._ecc_growth(gpu, kind)
        for flag in _MEMORY_FLAGS:
            self._memory_flag(gpu, flag, bool(getattr(health, flag)), "nvml")
        self._publish()

    def on_ecc_growth(self, gpu: GpuRef, kind: str) -> None:
        """ECC errors of `kind` (`sbe`, `dbe`) grew on this GPU (NVML event, NVML poll or DCGM)."""
        self._ecc_growth(gpu, kind)
        self._publish()

    def on_memory_flag(self, gpu: GpuRef, flag: str, active: bool, source: str) -> None:
        """A memory state flag (`remap_pending`, `remap_failure`, `retired_pages_pending`) as `source` sees it.

        The finding lasts while any source reports the flag, so a source that lags (DCGM) cannot flap it.
        """
        self._memory_flag(gpu, flag, active, source)
        self._publish()

    def on_gpu_link_errors(self, gpu: GpuRef, kind: str, detail: str) -> None:
        """NVLink errors or PCIe replays (`nvlink`, `pcie_replay`) grow faster than their threshold."""
        code, text = _LINK_ERRORS[kind]
        key = f"{kind}:{gpu.uuid or gpu.bus_id}"
        if key not in self.book:
            log.warning("%s on %s: %s", text, gpu.name, detail, extra={"gpu_uuid": gpu.uuid, "kind": kind})
        # The reason stays the same while the numbers change, so repeats extend the hold and publish nothing.
        self._add(self._hold(key, Severity.parse(self.config.dcgm_link_error_action), f"{text} on {gpu.name}", code,
                             hardware=True))
        self._publish()

    def _ecc_growth(self, gpu: GpuRef, kind: str) -> None:
        code, text = _ECC[kind]
        self._add(self._hold(f"{kind}:{gpu.uuid or gpu.bus_id}", Severity.DEGRADED, f"{text} on {gpu.name}", code,
                             hardware=True))

    def _memory_flag(self, gpu: GpuRef, flag: str, active: bool, source: str) -> None:
        key, code, hardware, text, severity = _MEMORY_FLAGS[flag]
        if severity is Severity.HEALTHY:  # an advisory: no device made Unhealthy, a reset advised
            finding = Finding(f"{key}:{gpu.uuid or gpu.bus_id}", severity, f"{gpu.name}: {text}", Clears.STATE,
                              gpu_uuid=gpu.uuid, code=code, recovery=GpuRecoveryAction.GPU_RESET)
        else:
            finding = Finding(f"{key}:{gpu.uuid or gpu.bus_id}", severity, f"{gpu.name}: {text}", Clears.STATE,
                              (gpu.uuid,) if gpu.uuid else (), code=code, hardware=hardware)
        self._state(active, finding, source)

    def on_link(self, nic: Nic, up: bool, detail: str = "") -> None:
        """A link check of an RDMA PF: while it is down, it and its VFs are Unhealthy."""
        before = self.links.get(nic.bus_id)
        self.links[nic.bus_id] = LinkStatus(nic, up, detail)
        if (before.up if before is not None else True) != up:
            log.warning("%s (%s) link %s%s", nic.netdevs[0] if nic.netdevs else nic.rdma, nic.bus_id,
                        "up" if up else "down", f": {detail}" if detail else "",
                        extra={"nic": nic.bus_id, "link_up": up})
        name = nic.netdevs[0] if nic.netdevs else (nic.rdma or nic.bus_id)
        devices = (nic.bus_id, *(vf.bus_id for vf in nic.vfs))
        self._state(not up, Finding(f"link:{nic.bus_id}", Severity.parse(self.config.link_down_action),
                                    f"NIC {name} ({nic.bus_id}) link down: {detail}", Clears.STATE, devices,
                                    code="NicLinkDown"), "links")
        self._publish()

    def on_findings(self, source: str, findings: list[Finding]) -> None:
        """A producer's whole current set of findings (keys start with `source`): the ones it no longer lists end."""
        keep = {f.key for f in findings}
        for finding in findings:
            self._add(finding)
        for finding in self.book.findings():
            if finding.key.startswith(source) and finding.key not in keep:
                self.book.remove(finding.key)
        self._publish()

    def tick(self) -> None:
        """Housekeeping: HOLD findings expire, quiet Xid bursts end."""
        now = self.clock()
        self.xids.sweep(now)
        if self.book.expire(now):
            self._publish()

    def restore(self, findings: list[Finding]) -> None:
        """Findings that were waiting for a reset when the agent stopped (same boot)."""
        for finding in findings:
            self.book.add(finding)
        if findings:
            log.warning("still waiting for a GPU reset: %s", "; ".join(f.reason for f in findings))
        self._publish()

    def _mig_target(self, gpu: GpuRef, code: int, gpu_instance: int | None) -> MigDevice | None:
        """The MIG device an Xid naming `GPU-I:<n>` is about, unless the code is GPU-wide (then the parent GPU,
        and with it every MIG device on it, is named)."""
        if gpu_instance is None or not gpu.uuid or self.policy.gpu_wide(code):
            return None
        parent = self.topology.gpu_by_uuid(gpu.uuid)
        return parent.mig_device(gpu_instance) if parent is not None else None

    def _hold(self, key: str, severity: Severity, reason: str, code: str, hardware: bool = False) -> Finding:
        expires = self.clock() + self.config.degraded_hold_seconds
        return Finding(key, severity, reason, Clears.HOLD, expires_at=expires, code=code, hardware=hardware)

    def _lost_finding(self, gpu: GpuRef, reason: str, severity: Severity, code: str) -> Finding:
        return Finding(f"lost:{gpu.uuid or gpu.bus_id}", severity, reason, Clears.RESET,
                       (gpu.uuid,) if gpu.uuid else (), gpu.uuid, code=code, hardware=True,
                       recovery=GpuRecoveryAction.NODE_REBOOT)  # off the bus: only a reboot brings it back

    def _state(self, active: bool, finding: Finding, source: str) -> None:
        """A STATE finding: raised while any source reports the condition, ended when the last says it is gone."""
        if self._reporters.report(finding.key, source, active):
            self._add(finding)
        elif self.book.remove(finding.key) is not None:
            log.info("cleared: %s", finding.reason)

    def _add(self, finding: Finding) -> None:
        if self.book.add(finding) and finding.clears is Clears.RESET:
            self.awaiting_reset_changed = True

    def _publish(self) -> None:
        self.publisher.publish(self.book)


def _dropped(before: MemoryHealth, after: MemoryHealth) -> bool:
    """Volatile ECC counts only go down when the driver reloads or the GPU resets."""
    pairs = ((before.ecc_corrected_volatile, after.ecc_corrected_volatile),
             (before.ecc_uncorrected_volatile, after.ecc_uncorrected_volatile))
    return any(old is not None and new is not None and new < old for old, new in pairs)
