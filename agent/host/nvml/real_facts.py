"""`RealNvml.facts`: what node labels describe, read through nvidia-ml-py as GPU Feature Discovery reads it.

The calls are GFD's (NVIDIA/k8s-device-plugin internal/resource, go-nvlib): `nvmlSystemGetDriverVersion`,
`nvmlSystemGetCudaDriverVersion` (the CUDA version the driver supports, not a runtime), per GPU its name,
`memory.total` in MiB, `nvmlDeviceGetCudaComputeCapability`, `nvmlDeviceGetMigMode` (NOT_SUPPORTED: not MIG
capable), fabric info (clique), and per MIG device `nvmlDeviceGetAttributes` with the profile named as go-nvlib
names it (`+me`, `+me.all`, `+gfx`, `-me` from the GPU instance's profile id). One failing GPU-wide query fails
the reading: labels keep their last values rather than publish a partial set.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from types import ModuleType
from typing import Any

from agent.host.busid import normalize_bus_id
from agent.host.nvml.api import (
    _ARGUMENT_VERSION_MISMATCH,
    _FUNCTION_NOT_FOUND,
    _NOT_SUPPORTED,
    FABRIC_COMPLETED,
    GpuFacts,
    MigFacts,
    NvmlError,
    NvmlFacts,
    _code,
    _text,
    mig_profile_name,
)
from agent.host.nvml.real_mig import mig_handles

_SUCCESS = 0
# GPU instance profile ids (nvmlGpuInstanceProfile*) -> go-nvlib's profile attribute suffix
_SUFFIX = {7: "+me", 8: "+me", 15: "+me.all", 16: "+me.all", 10: "+gfx", 11: "+gfx", 12: "+gfx", 13: "-me", 14: "-me"}


def _mig_capable(nvml: ModuleType, handle: Any) -> tuple[bool, bool]:
    """(capable, enabled): go-nvlib `IsMigCapable` (NOT_SUPPORTED means not capable) and the current mode."""
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except nvml.NVMLError as exc:
        if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
            return False, False
        raise
    return True, int(current) == 1


def _suffix(nvml: ModuleType, parent: Any, gpu_instance: int) -> str:
    """The profile attribute suffix of a GPU instance ("" for a plain profile or when the driver cannot say)."""
    try:
        instance = nvml.nvmlDeviceGetGpuInstanceById(parent, gpu_instance)
        return _SUFFIX.get(int(nvml.nvmlGpuInstanceGetInfo(instance).profileId), "")
    except (nvml.NVMLError, AttributeError):
        return ""


def _mig_devices(nvml: ModuleType, handle: Any, total_bytes: int) -> tuple[MigFacts, ...]:
    found: list[MigFacts] = []
    for mig in mig_handles(nvml, handle):
        a = nvml.nvmlDeviceGetAttributes(mig)
        gi, ci, memory = int(a.gpuInstanceSliceCount), int(a.computeInstanceSliceCount), int(a.memorySizeMB)
        profile = mig_profile_name(gi, ci, memory, total_bytes) + \
            _suffix(nvml, handle, int(nvml.nvmlDeviceGetGpuInstanceId(mig)))
        found.append(MigFacts(_text(nvml.nvmlDeviceGetUUID(mig)), profile, memory, int(a.multiprocessorCount), gi, ci,
                              int(a.sharedCopyEngineCount), int(a.sharedDecoderCount), int(a.sharedEncoderCount),
                              int(a.sharedJpegCount), int(a.sharedOfaCount)))
    return tuple(found)


def _clique(nvml: ModuleType, handle: Any) -> tuple[str, str] | None:
    """go-nvlib `IsFabricAttached` then `GetFabricIDs`: state completed, status success, cluster UUID set. The v3
    struct through nvmlDeviceGetGpuFabricInfoV, the v1 call for a driver without it."""
    info = None
    for call, struct in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t"),
                         ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")):
        if not hasattr(nvml, call) or not hasattr(nvml, struct):
            continue
        info = getattr(nvml, struct)()
        try:
            getattr(nvml, call)(handle, ctypes.byref(info))
            break
        except nvml.NVMLError as exc:
            if _code(exc) in (_NOT_SUPPORTED,):
                return None
            if _code(exc) in (_FUNCTION_NOT_FOUND, _ARGUMENT_VERSION_MISMATCH):
                info = None
                continue
            raise
    if info is None:
        return None
    raw = bytes(info.clusterUuid)
    if int(info.state) != FABRIC_COMPLETED or int(info.status) != _SUCCESS or not any(raw):
        return None
    return str(uuidlib.UUID(bytes=raw)), str(int(info.cliqueId))


def _gpu(nvml: ModuleType, handle: Any) -> GpuFacts:
    total = int(nvml.nvmlDeviceGetMemoryInfo(handle).total)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    capable, enabled = _mig_capable(nvml, handle)
    return GpuFacts(uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    bus_id=normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
                    name=_text(nvml.nvmlDeviceGetName(handle)), memory_mib=total >> 20 or None,
                    compute_capability=(int(major), int(minor)), mig_capable=capable, mig_enabled=enabled,
                    mig_devices=_mig_devices(nvml, handle, total) if enabled else (), clique=_clique(nvml, handle))


def read_facts(nvml: ModuleType) -> NvmlFacts:
    """One reading over the initialised library (the caller holds the session); NvmlError when any part fails."""
    try:
        gpus = tuple(_gpu(nvml, nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(int(nvml.nvmlDeviceGetCount())))
        return NvmlFacts(_text(nvml.nvmlSystemGetDriverVersion()), int(nvml.nvmlSystemGetCudaDriverVersion()), gpus)
    except (nvml.NVMLError, ValueError, TypeError, AttributeError, ctypes.ArgumentError) as exc:
        raise NvmlError(f"label facts: {type(exc).__name__}: {exc}") from exc
