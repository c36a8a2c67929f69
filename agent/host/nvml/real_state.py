"""The parts of `RealNvml.gpu_state` through nvidia-ml-py: NVLink link states, the GPU's fabric info and the
driver's recovery-action field (the library comes in as a module: only `agent.host.nvml.real` imports `pynvml`).

Each reader copes with older drivers (a field it does not know, an older struct version or call) and names what
the GPU does not support through `unsupported` (logged once per GPU by `RealNvml`). A lost GPU raises
`GpuLostError`; `RealNvml` then drops its handle.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from types import ModuleType
from typing import Any

from agent.host.nvml.api import (
    _ARGUMENT_VERSION_MISMATCH,
    _FUNCTION_NOT_FOUND,
    _GPU_IS_LOST,
    _INVALID_ARGUMENT,
    _NOT_SUPPORTED,
    _RESET_REQUIRED,
    FABRIC_NOT_SUPPORTED,
    GpuFabric,
    GpuLostError,
    NvmlError,
    _code,
)

_MAX_LINKS = 36  # NVML_NVLINK_MAX_LINKS in nvidia-ml-py 13.615.71 (used when the library does not say)
_RECOVERY_FIELD = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (replaces the deprecated fields 226 and 227)
_LINK_STATE_FIELD = 165  # NVML_FI_DEV_NVLINK_GET_STATE, scoped per link: INACTIVE 0, ACTIVE 1, SLEEP 2,
_LINK_UP = (1, 2)  # ACTIVE_TRAFFIC_DISABLED 3. A link asleep to save power wakes on traffic: not a fault.
_NO_SUCH_LINK = (_NOT_SUPPORTED, _INVALID_ARGUMENT, _FUNCTION_NOT_FOUND)
# nvmlValueType_t -> member of the c_nvmlValue_t union holding a field value
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


def read_nvlinks(nvml: ModuleType, uuid: str, h: Any) -> dict[int, bool]:
    """Link states of links 0..NVML_NVLINK_MAX_LINKS-1: field NVML_FI_DEV_NVLINK_GET_STATE for all of them in
    one call where the driver has it (it tells a sleeping link from an inactive one), else
    nvmlDeviceGetNvLinkState per link. A link the GPU lacks answers NOT_SUPPORTED or INVALID_ARGUMENT (a PCIe
    board: every link)."""
    count = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", _MAX_LINKS))
    links = _nvlinks_by_field(nvml, uuid, h, count)
    if links:
        return links
    for link in range(count):
        try:
            links[link] = nvml.nvmlDeviceGetNvLinkState(h, link) == 1  # NVML_FEATURE_ENABLED
        except nvml.NVMLError as exc:
            if _code(exc) not in _NO_SUCH_LINK:
                raise
    return links


def _nvlinks_by_field(nvml: ModuleType, uuid: str, h: Any, count: int) -> dict[int, bool]:
    """The link-state field, scoped per link; {} when the driver reports none (then the per-link call)."""
    field_id = int(getattr(nvml, "NVML_FI_DEV_NVLINK_GET_STATE", _LINK_STATE_FIELD))
    try:
        values = nvml.nvmlDeviceGetFieldValues(h, [(field_id, link) for link in range(count)])
    except nvml.NVMLError as exc:
        if _code(exc) in (_GPU_IS_LOST, _RESET_REQUIRED):
            raise
        return {}
    links: dict[int, bool] = {}
    for link, value in enumerate(values):
        code = int(value.nvmlReturn)
        if code in (_GPU_IS_LOST, _RESET_REQUIRED):
            raise GpuLostError(uuid, f"NVLink state field: NVML return code {code}")
        if code == 0:
            links[link] = _field_value(value) in _LINK_UP
    return links


def read_fabric(nvml: ModuleType, h: Any, unsupported: Callable[[str], None]) -> GpuFabric | None:
    """nvmlDeviceGetGpuFabricInfoV with the v3 struct; v2 for a driver that rejects v3's version, the
    deprecated v1 call for one without the versioned call. None when the GPU has no fabric."""
    attempts: list[tuple[str, str]] = [("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t"),
                                       ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t"),
                                       ("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t")]
    for call, struct in attempts:
        if not hasattr(nvml, call) or not hasattr(nvml, struct):
            continue
        info = getattr(nvml, struct)()
        try:
            getattr(nvml, call)(h, ctypes.byref(info))  # the wrapper hands its argument to C as is
        except nvml.NVMLError as exc:
            if _code(exc) in (_ARGUMENT_VERSION_MISMATCH, _FUNCTION_NOT_FOUND):
                continue  # an older driver: try the older struct or call
            if _code(exc) == _NOT_SUPPORTED:
                unsupported("GPU fabric info")
                return None
            raise
        if int(info.state) == FABRIC_NOT_SUPPORTED:
            return None
        return GpuFabric(int(info.state), int(info.status), int(getattr(info, "healthMask", 0)),
                         int(getattr(info, "healthSummary", 0)))
    unsupported("GPU fabric info")
    return None


def read_recovery_action(nvml: ModuleType, uuid: str, h: Any, unsupported: Callable[[str], None]) -> int | None:
    """Field NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; each field value carries its own return code."""
    field_id = int(getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", _RECOVERY_FIELD))
    value = nvml.nvmlDeviceGetFieldValues(h, [field_id])[0]
    code = int(value.nvmlReturn)
    if code in (_GPU_IS_LOST, _RESET_REQUIRED):
        raise GpuLostError(uuid, f"recovery-action field: NVML return code {code}")
    if code in _NO_SUCH_LINK:  # an older driver does not know the field
        unsupported("GPU recovery-action field")
        return None
    if code != 0:
        raise NvmlError(f"{uuid}: recovery-action field: NVML return code {code}")
    return _field_value(value)


def _field_value(value: Any) -> int:
    """An integer field value from the union member its `valueType` names."""
    return int(getattr(value.value, _VALUE_MEMBERS.get(int(value.valueType), "uiVal")))
