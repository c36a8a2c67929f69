"""A stand-in for libnvidia-ml.so.1 under the real `pynvml` wrappers, for machines without an NVIDIA driver.

`pynvml` resolves every C function through `_nvmlGetFunctionPointer`, which consults a cache before the loaded
library. `StandInLibNvml` puts ctypes callbacks with the C signatures (from NVML's headers as nvidia-ml-py
13.615.71 calls them) into that cache and marks the library loaded, so `RealNvml` runs unchanged over the real
wrappers: struct versions, `byref` arguments, per-field return codes and error classes are the real ones. The
answers follow NVML's documented behaviour: a link the GPU does not have is NVML_ERROR_NOT_SUPPORTED or
NVML_ERROR_INVALID_ARGUMENT, `nvmlDeviceGetFieldValues` succeeds and reports per field (link-state fields scoped
by link in `scopeId`), a lost GPU is NVML_ERROR_GPU_IS_LOST. Not modelled: anything the agent does not call here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pynvml

_VP = ctypes.c_void_p


@dataclass
class StandInGpu:
    """One GPU as the stand-in library answers for it."""

    uuid: str
    links: dict[int, bool] = field(default_factory=lambda: dict.fromkeys(range(18), True))
    fabric_state: int = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    fabric_status: int = pynvml.NVML_SUCCESS
    health_mask: int = 0
    health_summary: int = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
    recovery_action: int = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    recovery_return: int = pynvml.NVML_SUCCESS
    lost: bool = False
    link_state_field: bool = True  # False: a driver without NVML_FI_DEV_NVLINK_GET_STATE (per-field NOT_SUPPORTED)
    sleeping: set[int] = field(default_factory=set)  # links in NVML_NVLINK_STATE_SLEEP (the field tells; the call
    # nvmlDeviceGetNvLinkState is assumed to say DISABLED for them [unconfirmed])


class StandInLibNvml:
    """Callbacks for the C functions `RealNvml` uses; `install()` puts them under the real `pynvml`."""

    def __init__(self, gpus: list[StandInGpu]) -> None:
        self.gpus = gpus
        self.calls = 0
        proto = ctypes.CFUNCTYPE
        self._functions: dict[str, Any] = {
            "nvmlInitWithFlags": proto(ctypes.c_int, ctypes.c_uint)(lambda flags: pynvml.NVML_SUCCESS),
            "nvmlDeviceGetHandleByUUID": proto(ctypes.c_int, ctypes.c_char_p, _VP)(self._handle),
            "nvmlDeviceGetNvLinkState": proto(ctypes.c_int, _VP, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint))(
                self._link_state),
            "nvmlDeviceGetGpuFabricInfoV": proto(ctypes.c_int, _VP, ctypes.POINTER(
                pynvml.c_nvmlGpuFabricInfo_v3_t))(self._fabric),
            "nvmlDeviceGetFieldValues": proto(ctypes.c_int, _VP, ctypes.c_int32, _VP)(self._field_values),
        }

    def _gpu(self, handle: int | None) -> StandInGpu | None:
        index = (handle or 0) - 1
        return self.gpus[index] if 0 <= index < len(self.gpus) else None

    def _handle(self, uuid: bytes, out: int | None) -> int:
        self.calls += 1
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid.encode() == uuid:
                ctypes.cast(out, ctypes.POINTER(_VP))[0] = index + 1
                return pynvml.NVML_ERROR_GPU_IS_LOST if gpu.lost else pynvml.NVML_SUCCESS
        return pynvml.NVML_ERROR_NOT_FOUND

    def _link_state(self, handle: int | None, link: int, active: Any) -> int:
        self.calls += 1
        gpu = self._gpu(handle)
        if gpu is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if gpu.lost:
            return pynvml.NVML_ERROR_GPU_IS_LOST
        if link not in gpu.links:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT if gpu.links else pynvml.NVML_ERROR_NOT_SUPPORTED
        up = gpu.links[link] and link not in gpu.sleeping
        active[0] = pynvml.NVML_FEATURE_ENABLED if up else pynvml.NVML_FEATURE_DISABLED
        return pynvml.NVML_SUCCESS

    def _fabric(self, handle: int | None, info: Any) -> int:
        self.calls += 1
        gpu = self._gpu(handle)
        if gpu is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if info.contents.version != pynvml.nvmlGpuFabricInfo_v3:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if gpu.fabric_state == pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        out = info.contents
        out.state, out.status = gpu.fabric_state, gpu.fabric_status
        out.healthMask, out.healthSummary = gpu.health_mask, gpu.health_summary
        return pynvml.NVML_SUCCESS

    def _field_values(self, handle: int | None, count: int, address: int | None) -> int:
        self.calls += 1
        values = ctypes.cast(address, ctypes.POINTER(pynvml.c_nvmlFieldValue_t))
        gpu = self._gpu(handle)
        if gpu is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        for i in range(count):
            value = values[i]
            value.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            if gpu.lost:
                value.nvmlReturn = pynvml.NVML_ERROR_GPU_IS_LOST
            elif value.fieldId == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                value.nvmlReturn, value.value.uiVal = gpu.recovery_return, gpu.recovery_action
            elif value.fieldId == pynvml.NVML_FI_DEV_NVLINK_GET_STATE and gpu.link_state_field:
                link = value.scopeId
                if link not in gpu.links:
                    value.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT if gpu.links \
                        else pynvml.NVML_ERROR_NOT_SUPPORTED
                    continue
                value.nvmlReturn = pynvml.NVML_SUCCESS
                value.value.uiVal = pynvml.NVML_NVLINK_STATE_SLEEP if link in gpu.sleeping else \
                    pynvml.NVML_NVLINK_STATE_ACTIVE if gpu.links[link] else pynvml.NVML_NVLINK_STATE_INACTIVE
            else:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return pynvml.NVML_SUCCESS

    @contextmanager
    def install(self) -> Iterator[StandInLibNvml]:
        """Make the real `pynvml` call these functions (and believe its library loaded) inside the block."""
        cache = pynvml._nvmlGetFunctionPointer_cache
        saved_cache, saved_lib = dict(cache), pynvml.nvmlLib
        cache.update(self._functions)
        pynvml.nvmlLib = object()  # "loaded": anything not registered above answers FUNCTION_NOT_FOUND
        try:
            yield self
        finally:
            cache.clear()
            cache.update(saved_cache)
            pynvml.nvmlLib = saved_lib
