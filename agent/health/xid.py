"""NVIDIA's Xid catalog as data, the action each code gets, and counting Xids without flooding.

The buckets are NVIDIA's "immediate action" column (mirrored in NVIDIA/NVSentinel's xiderrorsmapping.csv); the
default action follows from the bucket: reset/reboot/ECC/NVLink workflows drain, physical checks and vendor
cases cordon, application-level codes (RESTART_APP, IGNORE) are only counted; one GPU's memory faults that need
that GPU reset (48 through its workflow, 64, 95) isolate that GPU. Xid 63 (a row-remap event, IGNORE) and 94 (a
contained ECC error, RESTART_APP) are counted only, as the catalog says: NVIDIA's memory-error guide says that
with a remap pending "unaffected applications can continue running ... and new workloads can be launched"; the
pending remap is an advisory (`RESET_ADVISED_XIDS`: a reset once the GPU is idle applies it). Operators override
any code (`--xid-action 109=none`, `--xid-action 94=isolate`).

`XidCounter` is what makes a 10 000-strong Xid 45 flood harmless: every occurrence is counted for the metric,
but only the first of a burst (repeats closer than the burst window) is logged and acted on. It also merges the
two views of one Xid - the NVML event and the kernel-log line - so a single fault is counted once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.health.findings import GpuRef
from agent.signals import XID_NONE, GpuRecoveryAction, Severity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class XidInfo:
    """One catalog row."""

    code: int
    mnemonic: str
    bucket: str


_ROWS: tuple[tuple[int, str, str], ...] = (
    (8, "FIFO_ERROR_IDLE_TIMEOUT", "RESTART_APP"),
    (13, "GR_EXCEPTION", "RESTART_APP"),
    (31, "FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP"),
    (32, "PBDMA_ERROR", "RESTART_APP"),
    (43, "RESETCHANNEL_VERIF_ERROR", "IGNORE"),
    (45, "PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45"),
    (46, "GPU_TIMEOUT_ERROR", "RESET_GPU"),
    (48, "GPU_ECC_DBE", "WORKFLOW_XID_48"),
    (54, "PWR_REDUCED_CLOCKING", "CHECK_MECHANICALS"),
    (62, "PMU_HALT_ERROR", "RESET_GPU"),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "IGNORE"),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "RESET_GPU"),
    (68, "NVDEC0_ERROR", "RESTART_APP"),
    (74, "NVLINK_ERROR", "WORKFLOW_NVLINK_ERR"),
    (79, "GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM"),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "IGNORE"),
    (94, "CONTAINED_ERROR", "RESTART_APP"),
    (95, "UNCONTAINED_ERROR", "RESET_GPU"),
    (109, "CTXSW_TIMEOUT_ERROR", "RESET_GPU"),
    (110, "SEC_FAULT_ERROR", "RESET_GPU"),
    (119, "GSP_RPC_TIMEOUT", "RESET_GPU"),
    (120, "GSP_ERROR", "RESET_GPU"),
    (136, "ALI_TRAINING_FAIL", "RESET_GPU"),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "RESET_GPU"),
    (143, "GPU_INIT_ERROR", "RESET_GPU"),
    (144, "NVLINK_SAW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (145, "NVLINK_RLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (146, "NVLINK_TLW_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (147, "NVLINK_TREX_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (148, "NVLINK_NVLPW_CTRL_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (149, "NVLINK_NETIR_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (150, "NVLINK_MSE_ERROR", "WORKFLOW_NVLINK5_ERR"),
    (151, "KEY_ROTATION_ERROR", "RESTART_VM"),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "FOLLOW_LINKED_XID"),
    (155, "NVLINK_SW_DEFINED_ERROR", "RESET_GPU"),
    (156, "RESOURCE_RETIREMENT_EVENT", "RESET_GPU"),
    (158, "GPU_FATAL_TIMEOUT", "RESET_GPU"),
    (160, "CHANNEL_RETIREMENT_EVENT", "RESTART_BM"),
)

CATALOG: Mapping[int, XidInfo] = {code: XidInfo(code, name, bucket) for code, name, bucket in _ROWS}

BUCKET_ACTIONS: Mapping[str, Severity] = {
    "RESTART_APP": Severity.HEALTHY,
    "IGNORE": Severity.HEALTHY,
    "WORKFLOW_XID_45": Severity.HEALTHY,  # a cascade of an earlier Xid: never acted on by itself
    "UPDATE_SWFW": Severity.HEALTHY,
    "CHECK_UVM": Severity.HEALTHY,
    "FOLLOW_LINKED_XID": Severity.HEALTHY,  # Xid 154: the linked Xid carries the action
    "CHECK_MECHANICALS": Severity.CORDON,
    "CONTACT_SUPPORT": Severity.CORDON,
    "RESET_GPU": Severity.DRAIN,
    "RESTART_BM": Severity.DRAIN,
    "RESTART_VM": Severity.DRAIN,
    "WORKFLOW_XID_48": Severity.DRAIN,
    "WORKFLOW_NVLINK_ERR": Severity.DRAIN,
    "WORKFLOW_NVLINK5_ERR": Severity.DRAIN,
}
HARDWARE_BUCKETS = frozenset({"RESTART_BM", "WORKFLOW_XID_48", "WORKFLOW_NVLINK_ERR", "WORKFLOW_NVLINK5_ERR",
                              "CHECK_MECHANICALS", "CONTACT_SUPPORT"})  # a reset alone is not expected to cure
#: Faults of one GPU's memory that need that GPU reset and that the device plugin can contain: the GPU stays
#: Unhealthy until a reset and only the pods holding it are drained, while the other GPUs keep working (a second
#: device isolated at the same time drains the node, see agent.health.verdict). DBE (48, WORKFLOW_XID_48), row-remap
#: failure (64, RESET_GPU), uncontained ECC error (95, RESET_GPU). Not 63 (IGNORE) nor 94 (RESTART_APP): the
#: catalog asks nothing of the GPU for them.
DEVICE_SCOPED_XIDS = frozenset({48, 64, 95})
#: Codes whose effect waits for the next reset without harming work meanwhile: Xid 63, a row remap recorded and
#: pending until the GPU resets. An advisory (`gpu_node_agent_gpu_reset_pending`), and with a reset command a
#: reset once the GPU is idle; never a reason to take the GPU out of service.
RESET_ADVISED_XIDS = frozenset({63})
_BUCKET_RECOVERY: Mapping[str, GpuRecoveryAction] = {
    "RESTART_BM": GpuRecoveryAction.NODE_REBOOT, "RESTART_VM": GpuRecoveryAction.NODE_REBOOT,
    "RESET_GPU": GpuRecoveryAction.GPU_RESET}
UNKNOWN_XID_ACTION = Severity.DEGRADED  # visible, never disruptive: override it once you know the code


def action_word(action: Severity) -> str:
    """How an Xid action is spelled in overrides: `none` for healthy, else the severity's word."""
    return XID_NONE if action is Severity.HEALTHY else action.value


class XidPolicy:
    """The catalog plus the operator's overrides: what to do about each code."""

    def __init__(self, overrides: Mapping[int, str] | None = None) -> None:
        self._overrides = {code: Severity.parse(action) for code, action in (overrides or {}).items()}

    def action(self, code: int) -> Severity:
        """The action for an Xid code: override, else isolate for a device-scoped code, else the bucket's, else
        UNKNOWN_XID_ACTION."""
        if code in self._overrides:
            return self._overrides[code]
        if code in DEVICE_SCOPED_XIDS:
            return Severity.ISOLATE
        info = CATALOG.get(code)
        return UNKNOWN_XID_ACTION if info is None else BUCKET_ACTIONS.get(info.bucket, UNKNOWN_XID_ACTION)

    def table(self) -> list[dict[str, str | int]]:
        """The effective action of every catalogued or overridden code, with where it comes from."""
        rows: list[dict[str, str | int]] = []
        for code in sorted(set(CATALOG) | set(self._overrides)):
            info = CATALOG.get(code)
            source = ("override" if code in self._overrides else "device-scoped" if code in DEVICE_SCOPED_XIDS
                      else f"catalog {info.bucket}" if info else "default")
            action = self.action(code)
            rows.append({"xid": code, "name": info.mnemonic if info else "", "action": action_word(action),
                         "source": source})
        return rows

    @staticmethod
    def recovery(code: int) -> GpuRecoveryAction | None:
        """The recovery NVIDIA's bucket prescribes when it is more than the application's: a reboot for
        RESTART_BM / RESTART_VM, a GPU reset for RESET_GPU; None otherwise (or for an unknown code)."""
        info = CATALOG.get(code)
        return None if info is None else _BUCKET_RECOVERY.get(info.bucket)

    @staticmethod
    def gpu_wide(code: int) -> bool:
        """True when the code is about the whole GPU even on a line naming a MIG GPU instance (`GPU-I:<n>`): every
        bucket but the application-level RESTART_APP and IGNORE (those are contained to the instance, as NVIDIA's
        plugin treats an event with a GPU instance id). An unknown code is the instance's, as there."""
        info = CATALOG.get(code)
        return info is not None and info.bucket not in ("RESTART_APP", "IGNORE")

    @staticmethod
    def is_hardware(code: int) -> bool:
        """True when NVIDIA's bucket points at the hardware (bus loss, ECC/NVLink workflows, mechanicals)."""
        info = CATALOG.get(code)
        return info is not None and info.bucket in HARDWARE_BUCKETS

    @staticmethod
    def describe(code: int) -> str:
        """`Xid 79 (GPU_HAS_FALLEN_OFF_THE_BUS, RESTART_BM)`, or `Xid 999 (not in the catalog)`."""
        info = CATALOG.get(code)
        return f"Xid {code} ({info.mnemonic}, {info.bucket})" if info else f"Xid {code} (not in the catalog)"


@dataclass
class _Burst:
    first_at: float
    last_at: float
    count: int = 1
    by_source: dict[str, int] = field(default_factory=dict)  # within the pairing window
    paired_at: float = 0.0


@dataclass(frozen=True)
class XidRecord:
    """What `XidCounter.record` decided about one report."""

    counted: bool  # a new occurrence (False: the other source's view of one already counted)
    first_of_burst: bool  # log it and act on it


class XidCounter:
    """Occurrences per (GPU, code) for the metric, bursts for logging and acting, NVML/kmsg pairing."""

    def __init__(self, burst_window: float, pair_window: float = 5.0) -> None:
        self.burst_window = burst_window
        self.pair_window = pair_window
        self.totals: dict[tuple[GpuRef, int], int] = {}
        self._bursts: dict[tuple[GpuRef, int], _Burst] = {}

    def record(self, gpu: GpuRef, code: int, source: str, now: float, count: int = 1) -> XidRecord:
        """Count `count` reports of Xid `code` on `gpu` from `source` ("kmsg", "nvml", "dcgm") at monotonic `now`.

        Within the pairing window, reports from one source that do not outnumber another source's are that
        source's view of occurrences already counted.
        """
        key = (gpu, code)
        burst = self._bursts.get(key)
        if burst is not None and now - burst.last_at > self.burst_window:
            self._end(key, burst)
            burst = None
        if burst is None:
            self._bursts[key] = _Burst(now, now, count, by_source={source: count}, paired_at=now)
            self.totals[key] = self.totals.get(key, 0) + count
            return XidRecord(counted=True, first_of_burst=True)
        if now - burst.paired_at > self.pair_window:
            burst.by_source, burst.paired_at = {}, now
        others = max((n for s, n in burst.by_source.items() if s != source), default=0)
        before = burst.by_source.get(source, 0)
        burst.by_source[source] = before + count
        burst.last_at = now
        new = min(count, before + count - max(before, others))
        if new <= 0:
            return XidRecord(counted=False, first_of_burst=False)  # the other source already told us
        burst.count += new
        self.totals[key] = self.totals.get(key, 0) + new
        return XidRecord(counted=True, first_of_burst=False)

    def sweep(self, now: float) -> None:
        """End bursts that have been quiet for the burst window (logging how many repeats they had)."""
        for key, burst in list(self._bursts.items()):
            if now - burst.last_at > self.burst_window:
                self._end(key, burst)

    def _end(self, key: tuple[GpuRef, int], burst: _Burst) -> None:
        del self._bursts[key]
        if burst.count > 1:
            gpu, code = key
            log.info("%s on %s: burst over, %d occurrences in %.0f s", XidPolicy.describe(code), gpu.name,
                     burst.count, burst.last_at - burst.first_at,
                     extra={"gpu_uuid": gpu.uuid, "xid": code, "occurrences": burst.count})
