"""MIG devices through nvidia-ml-py, for `RealNvml.mig_devices` (the library comes in as a module: only
`agent.host.nvml.real` imports `pynvml`).

Per GPU in MIG mode: `nvmlDeviceGetMaxMigDeviceCount`, then `nvmlDeviceGetMigDeviceHandleByIndex` for each slot
(NVML_ERROR_NOT_FOUND: an empty slot), and per MIG device its UUID, `nvmlDeviceGetGpuInstanceId`,
`nvmlDeviceGetComputeInstanceId` and `nvmlDeviceGetAttributes` (slice counts, memory), named with the parent's
total memory as go-nvlib names profiles (`mig_profile_name`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from agent.host.nvml.api import MigInfo, _code, _text, mig_profile_name

log = logging.getLogger(__name__)

_NOT_FOUND = 6  # NVML_ERROR_NOT_FOUND: no MIG device in this slot


def mig_handles(nvml: ModuleType, handle: Any) -> Iterator[Any]:
    """The handles of a GPU's MIG devices, slot by slot: an empty slot is skipped, other NVML errors propagate."""
    for slot in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except nvml.NVMLError as exc:
            if _code(exc) == _NOT_FOUND:
                continue
            raise
        yield mig


def read_mig_devices(nvml: ModuleType, handle: Any) -> list[MigInfo]:
    """The MIG devices of one GPU in MIG mode (NVML errors other than an empty slot propagate)."""
    total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    found: list[MigInfo] = []
    for mig in mig_handles(nvml, handle):
        attributes = nvml.nvmlDeviceGetAttributes(mig)
        gpu_slices, compute_slices = int(attributes.gpuInstanceSliceCount), int(attributes.computeInstanceSliceCount)
        memory_mb = int(attributes.memorySizeMB)
        found.append(MigInfo(uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
                             gpu_instance=int(nvml.nvmlDeviceGetGpuInstanceId(mig)),
                             compute_instance=int(nvml.nvmlDeviceGetComputeInstanceId(mig)),
                             gpu_slices=gpu_slices, compute_slices=compute_slices, memory_mb=memory_mb,
                             profile=mig_profile_name(gpu_slices, compute_slices, memory_mb, total)))
    return found
