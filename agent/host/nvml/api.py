"""What the agent asks of NVML: the protocols, value types and errors both ports share."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

log = logging.getLogger(__name__)

_GPU_IS_LOST, _NOT_SUPPORTED, _TIMEOUT, _FUNCTION_NOT_FOUND, _RESET_REQUIRED = 15, 3, 10, 13, 16
_INVALID_ARGUMENT, _ARGUMENT_VERSION_MISMATCH = 2, 25

# nvmlGpuFabricState_t (NVML_GPU_FABRIC_STATE_*): the GPU's registration with the NVLink fabric (NVSwitch systems).
FABRIC_NOT_SUPPORTED, FABRIC_NOT_STARTED, FABRIC_IN_PROGRESS, FABRIC_COMPLETED = 0, 1, 2, 3
FABRIC_STATES = {FABRIC_NOT_SUPPORTED: "not_supported", FABRIC_NOT_STARTED: "not_started",
                 FABRIC_IN_PROGRESS: "in_progress", FABRIC_COMPLETED: "completed"}
# NVML_GPU_FABRIC_HEALTH_SUMMARY_* (nvmlGpuFabricInfo_v3_t.healthSummary)
FABRIC_SUMMARY_NOT_SUPPORTED, FABRIC_SUMMARY_HEALTHY, FABRIC_SUMMARY_UNHEALTHY, FABRIC_SUMMARY_LIMITED = 0, 1, 2, 3
# nvmlDeviceGpuRecoveryAction_t (NVML_GPU_RECOVERY_ACTION_*), the value of field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
RECOVERY_ACTIONS = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset",
                    5: "recover_imex_domain", 6: "bus_reset", 7: "system_reboot"}
_SBE, _DBE, _XID = 0x1, 0x2, 0x8  # nvmlEventTypeSingleBitEccError, DoubleBitEccError, XidCriticalError
_NO_INSTANCE = 0xFFFFFFFF


class NvmlError(Exception):
    """An NVML call failed for a reason other than a lost GPU or an unsupported call."""


class NvmlUnavailableError(NvmlError):
    """NVML is not there (no driver or library); the message says why."""


class GpuLostError(NvmlError):
    """The GPU fell off the bus or needs a reset: NVML_ERROR_GPU_IS_LOST or NVML_ERROR_RESET_REQUIRED."""

    def __init__(self, uuid: str, detail: str) -> None:
        super().__init__(f"{uuid}: {detail}")
        self.uuid = uuid


@dataclass(frozen=True)
class NvmlEvent:
    """One NVML event: kind "xid" (with `xid`), "sbe", "dbe", or "lost" (the GPU stopped answering)."""

    kind: str
    uuid: str
    xid: int = 0
    gpu_instance: int | None = None


@dataclass(frozen=True)
class MemoryHealth:
    """One poll of a GPU's memory health; None where the GPU or driver does not support the query."""

    uuid: str
    ecc_corrected_volatile: int | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_corrected: int | None = None
    remapped_rows_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None


@dataclass(frozen=True)
class GpuFabric:
    """nvmlGpuFabricInfo: the probe `state` (FABRIC_*), its `status` (an NVML return code, meaningful once
    COMPLETED), and with newer drivers the `health_mask` (NVML_GPU_FABRIC_HEALTH_MASK_* 2-bit fields) and
    `health_summary` (FABRIC_SUMMARY_*); 0 where the driver does not report them."""

    state: int
    status: int = 0
    health_mask: int = 0
    health_summary: int = 0


@dataclass(frozen=True)
class GpuState:
    """NVLink, fabric and the driver's requested recovery of one GPU.

    `nvlinks`: link number -> active, for the links NVML reports (empty: no NVLink, e.g. a PCIe board);
    `fabric`: None where not supported (no NVSwitch fabric, older GPU or driver); `recovery_action`: the NVML
    value (RECOVERY_ACTIONS), None where the field is not supported. A part whose query failed for another reason
    is missing from the values (empty / None) and named in `errors` (part -> why): "nvlink", "fabric",
    "recovery_action".
    """

    uuid: str
    nvlinks: dict[int, bool]
    fabric: GpuFabric | None = None
    recovery_action: int | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as `nvidia-smi -q` names it; None where the GPU or driver does not answer the query."""

    index: int
    name: str
    uuid: str
    bus_id: str
    mig_enabled: bool | None = None
    ecc_enabled: bool | None = None
    persistence: bool | None = None


@dataclass(frozen=True)
class NvmlInventory:
    """What the driver is and which of the calls the agent relies on it answers (`gpu-node-agent doctor`).

    `support`: call or field -> "yes", "no" (not supported by this GPU or driver) or what went wrong; asked of the
    first GPU: `nvlink_state_field` (field 165), `recovery_action_field` (field 230), `fabric_info` (the struct
    version the driver took: v3, v2, v1), `remapped_rows`, `process_list` (v3 or v2), `event_set`.
    """

    driver_version: str
    nvml_version: str
    cuda_version: str
    gpus: tuple[GpuInfo, ...]
    support: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class MigInfo:
    """One MIG device of a GPU in MIG mode: its UUID, GPU and compute instance ids, and NVIDIA's profile name
    (`mig_profile_name`: from the slice counts and the memory size, as go-nvlib names profiles)."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    gpu_slices: int
    compute_slices: int
    memory_mb: int
    profile: str


@dataclass(frozen=True)
class MigFacts:
    """What NVML says of one MIG device (nvmlDeviceGetAttributes): the facts a node label describes."""

    uuid: str
    profile: str  # NVIDIA's name, as go-nvlib prints it ("1g.10gb", "1c.2g.20gb")
    memory_mb: int
    multiprocessors: int
    gpu_slices: int
    compute_slices: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says of one GPU for node labels; None where the query failed (the label is then left out, as
    GPU Feature Discovery leaves it out). `clique`: (cluster UUID, clique id) when the GPU is attached to an
    NVLink fabric (state completed, status success, non-zero cluster UUID), else None."""

    uuid: str
    bus_id: str
    name: str
    memory_mib: int | None = None
    compute_capability: tuple[int, int] | None = None
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_devices: tuple[MigFacts, ...] = ()
    clique: tuple[str, str] | None = None


@dataclass(frozen=True)
class NvmlFacts:
    """One complete reading of what node labels describe: the driver, the CUDA version it supports (NVML's
    integer, 12040 for 12.4) and every GPU in NVML's index order."""

    driver_version: str
    cuda_driver_version: int
    gpus: tuple[GpuFacts, ...]


def mig_profile_name(gpu_slices: int, compute_slices: int, memory_mb: int, total_memory_bytes: int) -> str:
    """NVIDIA's MIG profile name: `<G>g.<GB>gb`, or `<C>c.<G>g.<GB>gb` when the compute instance takes fewer
    slices than its GPU instance. GB is the MIG device's share of the GPU's memory rounded up to eighths, times
    the GPU's memory in whole GiB (go-nvlib `getMigMemorySizeGB`), so an H100 80GB's 1-slice device is 10gb."""
    gib, mib = 1 << 30, 1 << 20
    eighths = -(-(memory_mb * mib * 8) // total_memory_bytes) if total_memory_bytes else 0
    total_gb = -(-total_memory_bytes // gib)
    gb = (eighths * total_gb * 2 + 8) // 16  # round half up of eighths/8 * total_gb
    prefix = "" if compute_slices == gpu_slices else f"{compute_slices}c."
    return f"{prefix}{gpu_slices}g.{gb}gb"


class Nvml(Protocol):
    """What the agent asks of NVML."""

    @property
    def available(self) -> bool:
        """True once NVML initialised."""

    def gpu_uuids(self) -> dict[str, str]:
        """GPU UUIDs keyed by canonical bus id (`0000:3b:00.0`); empty when NVML is unavailable."""

    def gpu_minors(self) -> dict[str, int]:
        """Device minor numbers (`/dev/nvidia<minor>`) keyed by canonical bus id; empty without NVML."""

    def mig_gpus(self) -> set[str]:
        """Canonical bus ids of GPUs whose current MIG mode is enabled."""

    def mig_devices(self) -> dict[str, list[MigInfo]]:
        """The MIG devices of each GPU in MIG mode, keyed by the parent's canonical bus id; empty without NVML."""


class NvmlEventSet(Protocol):
    """Registered Xid/ECC events of some GPUs. `wait` and `close` belong to one (blocking) thread; `interrupt`
    may come from any thread."""

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        """Events that arrived, or [] after the timeout or once interrupted. GpuLostError is reported as "lost"
        events."""

    def interrupt(self) -> None:
        """Make the running wait, and every later one, return within ~0.5 s (the agent is stopping)."""

    def close(self) -> None:
        """Free the event set."""


class NvmlHealth(Nvml, Protocol):
    """What the health checks ask of NVML."""

    @property
    def unavailable_reason(self) -> str:
        """Why NVML is unavailable ("" when it is available)."""

    def open_events(self, uuids: Iterable[str]) -> NvmlEventSet:
        """Register Xid and single/double-bit ECC events of these GPUs. NvmlUnavailableError without NVML."""

    def memory_health(self, uuid: str) -> MemoryHealth:
        """ECC counts, retired pages, remapped rows of one GPU. GpuLostError, NvmlUnavailableError."""

    def gpu_state(self, uuid: str) -> GpuState:
        """NVLink link states, fabric info and recovery action of one GPU. GpuLostError, NvmlUnavailableError;
        another failure of one part is reported in `GpuState.errors`, not raised."""


class NvmlSession(Nvml, Protocol):
    """What a GPU reset asks of NVML: who uses a GPU, and the session closed while the reset runs."""

    def running_processes(self, uuid: str) -> list[int]:
        """PIDs of the compute, graphics and MPS processes on the GPU. GpuLostError, NvmlUnavailableError,
        NvmlError."""

    def suspend(self, timeout_s: float) -> bool:
        """Close the NVML session (nvidia-smi refuses a reset while any process holds it): wait up to `timeout_s`
        for running calls; later calls wait until `resume`. False when the calls did not finish in time."""

    def resume(self) -> None:
        """Let calls run again on a fresh session."""


class NvmlFactsSource(Protocol):
    """What node labels ask of NVML."""

    def facts(self) -> NvmlFacts:
        """Driver, CUDA version and every GPU's name, memory, capability, MIG devices and fabric clique, all in
        one reading. NvmlUnavailableError without NVML; NvmlError when a GPU or a driver-wide query fails (a
        partial reading is never returned: labels keep their last values instead)."""


class NvmlPort(NvmlHealth, NvmlSession, NvmlFactsSource, Protocol):
    """The whole port, as the hardware owner holds it: health reads, GPU-reset support and label facts."""

    def inventory(self) -> NvmlInventory:
        """Versions, each GPU's basics and which calls the driver supports. NvmlUnavailableError without NVML."""


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
