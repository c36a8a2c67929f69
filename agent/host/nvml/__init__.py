"""The NVML port: the agent's only way to NVIDIA's management library.

`RealNvml` (in `real`, the only module that imports `pynvml`) talks to the driver; `SimulatedNvml` (in
`simulated`) answers for a simulated profile and takes injected faults (Xids, ECC errors, row remaps, lost GPUs,
unsupported calls) for tests and demos. Both share the small `Nvml` protocol, and `NvmlHealth` adds what the
health checks need: an event set (Xid, single/double-bit ECC), one memory-health poll per GPU and one
NVLink/fabric/recovery-action read per GPU (`gpu_state`). `NvmlSession` is what a GPU reset needs: the
processes on a GPU, and the session closed while the reset runs (`gate`). A node without the NVIDIA driver is
normal (CPU nodes, tests, laptops): NVML then reports itself unavailable, once, and the rest of the agent carries on.

NVML errors are translated at this boundary (by return code, never by message text): a lost GPU (or one that
needs a reset) is `GpuLostError`; a call the GPU or driver does not support leaves its field None; anything
else is `NvmlError`.
"""

from agent.host.nvml.api import (
    GpuFabric,
    GpuFacts,
    GpuInfo,
    GpuLostError,
    GpuState,
    MemoryHealth,
    MigFacts,
    MigInfo,
    Nvml,
    NvmlError,
    NvmlEvent,
    NvmlEventSet,
    NvmlFacts,
    NvmlFactsSource,
    NvmlHealth,
    NvmlInventory,
    NvmlPort,
    NvmlSession,
    NvmlUnavailableError,
    mig_profile_name,
)
from agent.host.nvml.real import RealNvml
from agent.host.nvml.simulated import SimulatedNvml

__all__ = [
    "GpuFabric",
    "GpuFacts",
    "GpuInfo",
    "GpuLostError",
    "GpuState",
    "MemoryHealth",
    "MigFacts",
    "MigInfo",
    "Nvml",
    "NvmlError",
    "NvmlEvent",
    "NvmlEventSet",
    "NvmlFacts",
    "NvmlFactsSource",
    "NvmlHealth",
    "NvmlInventory",
    "NvmlPort",
    "NvmlSession",
    "NvmlUnavailableError",
    "RealNvml",
    "SimulatedNvml",
    "mig_profile_name",
]
