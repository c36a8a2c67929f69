"""`RealNvml.inventory`: the driver's versions, each GPU's basics, and which calls the agent relies on it answers.

Read-only and one pass: every query stands alone, so one a driver lacks is reported ("no", or the error) and
the rest still run. The support probes ask the first GPU the same calls the health checks make.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable
from types import ModuleType
from typing import Any

from agent.host.busid import BusIdError, normalize_bus_id
from agent.host.nvml.api import (
    _ARGUMENT_VERSION_MISMATCH,
    _FUNCTION_NOT_FOUND,
    _INVALID_ARGUMENT,
    _NOT_SUPPORTED,
    GpuInfo,
    NvmlInventory,
    _code,
    _text,
)

_LINK_STATE_FIELD, _RECOVERY_FIELD = 165, 230
_UNSUPPORTED = (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND, _INVALID_ARGUMENT)


def _ask(nvml: ModuleType, call: Callable[[], Any]) -> Any:
    """The call's value, or None when it fails (any reason: the inventory shows what it could read)."""
    try:
        return call()
    except (nvml.NVMLError, AttributeError, TypeError, ValueError, ctypes.ArgumentError):
        return None


def _verdict(nvml: ModuleType, call: Callable[[], str]) -> str:
    """"yes" (or the version the call names), "no" when the GPU or driver does not support it, else the error."""
    try:
        return call()
    except nvml.NVMLError as exc:
        return "no" if _code(exc) in _UNSUPPORTED else f"error: {exc}"
    except (AttributeError, TypeError, ValueError, ctypes.ArgumentError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def _field(nvml: ModuleType, handle: Any, field_id: int, scope: int | None) -> str:
    request = [(field_id, scope)] if scope is not None else [field_id]
    code = int(nvml.nvmlDeviceGetFieldValues(handle, request)[0].nvmlReturn)
    return "yes" if code == 0 else "no" if code in _UNSUPPORTED else f"error: NVML return code {code}"


def _fabric(nvml: ModuleType, handle: Any) -> str:
    for call, struct, version in (("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t", "v3"),
                                  ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t", "v2"),
                                  ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t", "v1")):
        if not hasattr(nvml, call) or not hasattr(nvml, struct):
            continue
        info = getattr(nvml, struct)()
        try:
            getattr(nvml, call)(handle, ctypes.byref(info))
        except nvml.NVMLError as exc:
            if _code(exc) in (_ARGUMENT_VERSION_MISMATCH, _FUNCTION_NOT_FOUND):
                continue
            raise
        return version if int(info.state) != 0 else f"{version} (no fabric on this GPU)"
    return "no"


def _process_list(nvml: ModuleType, handle: Any) -> str:
    for version in ("v3", "v2"):
        call = getattr(nvml, f"nvmlDeviceGetComputeRunningProcesses_{version}", None)
        if call is None:
            continue
        try:
            call(handle)
        except nvml.NVMLError as exc:
            if _code(exc) == _FUNCTION_NOT_FOUND:
                continue
            raise
        return version
    return "no"


def _event_set(nvml: ModuleType, handle: Any) -> str:
    events = nvml.nvmlEventSetCreate()
    try:
        nvml.nvmlDeviceGetSupportedEventTypes(handle)
    finally:
        nvml.nvmlEventSetFree(events)
    return "yes"


def _support(nvml: ModuleType, handle: Any) -> dict[str, str]:
    return {
        "nvlink_state_field": _verdict(nvml, lambda: _field(nvml, handle, _LINK_STATE_FIELD, 0)),
        "recovery_action_field": _verdict(nvml, lambda: _field(nvml, handle, _RECOVERY_FIELD, None)),
        "fabric_info": _verdict(nvml, lambda: _fabric(nvml, handle)),
        "remapped_rows": _verdict(nvml, lambda: (nvml.nvmlDeviceGetRemappedRows(handle), "yes")[1]),
        "process_list": _verdict(nvml, lambda: _process_list(nvml, handle)),
        "event_set": _verdict(nvml, lambda: _event_set(nvml, handle)),
    }


def _flag(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _gpu(nvml: ModuleType, index: int, handle: Any) -> GpuInfo:
    bus = _ask(nvml, lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId)) or ""
    with contextlib.suppress(BusIdError):
        bus = normalize_bus_id(bus)
    mig = _ask(nvml, lambda: nvml.nvmlDeviceGetMigMode(handle)[0])
    ecc = _ask(nvml, lambda: nvml.nvmlDeviceGetEccMode(handle)[0])
    return GpuInfo(index, _text(_ask(nvml, lambda: nvml.nvmlDeviceGetName(handle)) or "?"),
                   _text(_ask(nvml, lambda: nvml.nvmlDeviceGetUUID(handle)) or "?"), bus,
                   _flag(mig), _flag(ecc), _flag(_ask(nvml, lambda: nvml.nvmlDeviceGetPersistenceMode(handle))))


def read_inventory(nvml: ModuleType) -> NvmlInventory:
    """One pass over the initialised library (the caller holds the session)."""
    cuda = _ask(nvml, lambda: int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
    count = int(_ask(nvml, nvml.nvmlDeviceGetCount) or 0)
    gpus: list[GpuInfo] = []
    first: Any = None
    for index in range(count):
        handle = _ask(nvml, lambda i=index: nvml.nvmlDeviceGetHandleByIndex(i))  # type: ignore[misc]
        if handle is None:
            gpus.append(GpuInfo(index, "?", "?", "", None, None, None))
            continue
        first = handle if first is None else first
        gpus.append(_gpu(nvml, index, handle))
    return NvmlInventory(_text(_ask(nvml, nvml.nvmlSystemGetDriverVersion) or "?"),
                         _text(_ask(nvml, nvml.nvmlSystemGetNVMLVersion) or "?"),
                         f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "?", tuple(gpus),
                         _support(nvml, first) if first is not None else {})
