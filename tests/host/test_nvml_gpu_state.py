"""The real NVML port's NVLink / fabric / recovery-action reads, against a stand-in `pynvml` that has the real
library's exception classes, ctypes structs (`c_nvmlGpuFabricInfo_v3_t`, `c_nvmlFieldValue_t`) and constants
(nvidia-ml-py 13.615.71), and answers the way NVML's documentation says the C calls do. No GPU here: the real
`pynvml` without libnvidia-ml.so.1 covers the missing-library path."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from agent.host.nvml import GpuFabric, GpuLostError, GpuState, NvmlUnavailableError, RealNvml
from tests.fakes.clock import FakeClock
from tests.fakes.libnvml import StandInGpu, StandInLibNvml

UUID = "GPU-a"


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to NVMLError_NotSupported etc.


def _fabric_call(state: int, status: int = 0, mask: int = 0, summary: int = 0, *,
                 accept: tuple[type, ...] = (pynvml.c_nvmlGpuFabricInfo_v3_t,)) -> Callable[[Any, Any], int]:
    """nvmlDeviceGetGpuFabricInfoV: fills the struct passed by reference; rejects other struct versions."""
    def call(handle: Any, info_ref: Any) -> int:
        info = info_ref._obj  # ctypes.byref(...) keeps its target: the call must get a reference, not a copy
        if not isinstance(info, accept):
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        info.state, info.status = state, status
        if hasattr(info, "healthMask"):
            info.healthMask = mask
        if hasattr(info, "healthSummary"):
            info.healthSummary = summary
        return pynvml.NVML_SUCCESS
    return call


def _fields(code: int = pynvml.NVML_SUCCESS, value: int = 0) -> Callable[[Any, list[Any]], Any]:
    """nvmlDeviceGetFieldValues: an array of c_nvmlFieldValue_t with a per-field return code; only the
    recovery-action field is known (a driver without the NVLink state field: links by the per-link call)."""
    def call(handle: Any, ids: list[Any]) -> Any:
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for i, field_id in enumerate(ids):
            known = field_id == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
            values[i].fieldId = field_id if known else field_id[0]
            values[i].nvmlReturn = code if known else pynvml.NVML_ERROR_NOT_SUPPORTED
            values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            values[i].value.uiVal = value
        return values
    return call


def _library(links: int = 18, **overrides: Any) -> types.ModuleType:
    lib = types.ModuleType("pynvml")
    for name in ("NVMLError", "NVML_NVLINK_MAX_LINKS", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
                 "NVML_FI_DEV_NVLINK_GET_STATE", "c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t",
                 "c_nvmlGpuFabricInfo_t"):
        setattr(lib, name, getattr(pynvml, name))
    lib.nvmlInit = lambda: None
    lib.nvmlDeviceGetHandleByUUID = lambda uuid: f"h-{uuid}"

    def link_state(handle: Any, link: int) -> int:
        if link >= links:  # a link this GPU does not have
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT if link % 2 else pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_ENABLED

    lib.nvmlDeviceGetNvLinkState = link_state
    lib.nvmlDeviceGetGpuFabricInfoV = _fabric_call(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED)
    lib.nvmlDeviceGetGpuFabricInfo = _fabric_call(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED,
                                                  accept=(pynvml.c_nvmlGpuFabricInfo_t,))
    lib.nvmlDeviceGetFieldValues = _fields()
    for name, value in overrides.items():
        setattr(lib, name, value)
    return lib


def test_reads_links_fabric_and_recovery_action() -> None:
    def link_state(handle: Any, link: int) -> int:
        if link >= 18:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return pynvml.NVML_FEATURE_DISABLED if link in (2, 9) else pynvml.NVML_FEATURE_ENABLED

    mask = pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
    lib = _library(nvmlDeviceGetNvLinkState=link_state, nvmlDeviceGetFieldValues=_fields(value=4),
                   nvmlDeviceGetGpuFabricInfoV=_fabric_call(pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0, mask, 3))
    state = RealNvml(lib).gpu_state(UUID)
    assert state.nvlinks == {link: link not in (2, 9) for link in range(18)}
    assert state.fabric == GpuFabric(3, 0, mask, 3) and state.recovery_action == 4 and state.errors == {}


def test_links_the_gpu_lacks_and_unsupported_parts_are_absent_not_errors() -> None:
    lib = _library(links=0, nvmlDeviceGetGpuFabricInfoV=lambda h, info: (_ for _ in ()).throw(
        _error(pynvml.NVML_ERROR_NOT_SUPPORTED)), nvmlDeviceGetFieldValues=_fields(pynvml.NVML_ERROR_NOT_SUPPORTED))
    assert RealNvml(lib).gpu_state(UUID) == GpuState(UUID, {}, None, None, {})
    not_supported_state = _library(nvmlDeviceGetGpuFabricInfoV=_fabric_call(pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED))
    assert RealNvml(not_supported_state).gpu_state(UUID).fabric is None


def test_older_drivers_get_the_older_fabric_struct_or_call() -> None:
    v2_only = _library(nvmlDeviceGetGpuFabricInfoV=_fabric_call(pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS, mask=1,
                                                                accept=(pynvml.c_nvmlGpuFabricInfo_v2_t,)))
    assert RealNvml(v2_only).gpu_state(UUID).fabric == GpuFabric(2, 0, 1, 0)
    no_versioned_call = _library(nvmlDeviceGetGpuFabricInfoV=lambda h, info: (_ for _ in ()).throw(
        _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)))
    assert RealNvml(no_versioned_call).gpu_state(UUID).fabric == GpuFabric(3, 0, 0, 0)  # v1: no mask, no summary


@pytest.mark.parametrize("part", ["nvlink", "fabric", "recovery_action"])
def test_another_error_fails_only_that_part(part: str) -> None:
    broken = {"nvlink": {"nvmlDeviceGetNvLinkState": lambda h, link: (_ for _ in ()).throw(
                  _error(pynvml.NVML_ERROR_UNKNOWN))},
              "fabric": {"nvmlDeviceGetGpuFabricInfoV": lambda h, info: (_ for _ in ()).throw(
                  _error(pynvml.NVML_ERROR_NO_PERMISSION))},
              "recovery_action": {"nvmlDeviceGetFieldValues": _fields(pynvml.NVML_ERROR_UNKNOWN)}}[part]
    state = RealNvml(_library(**broken)).gpu_state(UUID)
    assert list(state.errors) == [part]
    assert (state.nvlinks != {}, state.fabric is not None, state.recovery_action is not None) == tuple(
        p != part for p in ("nvlink", "fabric", "recovery_action"))


@pytest.mark.parametrize("where", ["nvmlDeviceGetNvLinkState", "nvmlDeviceGetGpuFabricInfoV",
                                   "nvmlDeviceGetHandleByUUID"])
def test_a_lost_gpu_raises(where: str) -> None:
    with pytest.raises(GpuLostError):
        RealNvml(_library(**{where: lambda *args: (_ for _ in ()).throw(_error(pynvml.NVML_ERROR_GPU_IS_LOST))})
                 ).gpu_state(UUID)
    with pytest.raises(GpuLostError):  # the field API reports it per field, not by raising
        RealNvml(_library(nvmlDeviceGetFieldValues=_fields(pynvml.NVML_ERROR_GPU_IS_LOST))).gpu_state(UUID)


def test_without_the_library_gpu_state_is_unavailable() -> None:
    nvml = RealNvml()  # nvidia-ml-py is installed, libnvidia-ml.so.1 is not: NVMLError_LibraryNotFound
    with pytest.raises(NvmlUnavailableError):
        nvml.gpu_state(UUID)
    assert "LibraryNotFound" in nvml.unavailable_reason


async def test_init_is_retried_on_the_injected_clock() -> None:
    attempts: list[int] = []

    def init() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise _error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    clock = FakeClock()
    nvml = RealNvml(_library(nvmlInit=init), clock=clock)
    assert not nvml.available and "DriverNotLoaded" in nvml.unavailable_reason
    await clock.advance(59)
    assert not nvml.available and len(attempts) == 1  # not before the retry interval
    await clock.advance(1)
    assert nvml.available and nvml.unavailable_reason == "" and len(attempts) == 2
    assert nvml.gpu_state(UUID).fabric == GpuFabric(3)


def test_through_the_real_pynvml_wrappers() -> None:
    """RealNvml over the real pynvml module, whose C functions are a stand-in libnvidia-ml (tests/fakes/libnvml)."""
    gpus = [StandInGpu("GPU-0"), StandInGpu("GPU-1", links={**dict.fromkeys(range(18), True), 3: False},
                                             fabric_state=pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS,
                                             health_summary=pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY,
                                             recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET),
            StandInGpu("GPU-2", links={}, fabric_state=pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED,
                       recovery_return=pynvml.NVML_ERROR_NOT_SUPPORTED),
            StandInGpu("GPU-3", lost=True)]
    with StandInLibNvml(gpus).install():
        nvml = RealNvml(pynvml)
        first, second, pcie = (nvml.gpu_state(f"GPU-{i}") for i in range(3))
        with pytest.raises(GpuLostError):
            nvml.gpu_state("GPU-3")
        gpus[0].recovery_return = pynvml.NVML_ERROR_UNKNOWN
        failing = nvml.gpu_state("GPU-0")
    assert first == GpuState("GPU-0", dict.fromkeys(range(18), True), GpuFabric(3), 0, {})
    assert second == GpuState("GPU-1", {**dict.fromkeys(range(18), True), 3: False}, GpuFabric(2, 0, 0, 1), 4, {})
    assert pcie == GpuState("GPU-2", {}, None, None, {})
    assert list(failing.errors) == ["recovery_action"] and failing.recovery_action is None
    assert failing.fabric == GpuFabric(3)
    assert pynvml.nvmlLib is None  # the stand-in is gone again


def test_link_state_field_first_per_link_call_on_older_drivers() -> None:
    """The field tells a sleeping link (power saving, wakes on traffic) from an inactive one; a driver without it
    gets the per-link call."""
    gpus = [StandInGpu("GPU-0", sleeping={4}), StandInGpu("GPU-1", links={**dict.fromkeys(range(18), True), 6: False},
                                                          link_state_field=False)]
    library = StandInLibNvml(gpus)
    with library.install():
        nvml = RealNvml(pynvml)
        nvml.gpu_state("GPU-0")
        library.calls = 0
        asleep = nvml.gpu_state("GPU-0")
        by_field_calls = library.calls
        older = nvml.gpu_state("GPU-1")
    assert asleep.nvlinks == dict.fromkeys(range(18), True)
    assert by_field_calls == 3  # link states in one field read, the fabric, the recovery-action field
    assert older.nvlinks == {**dict.fromkeys(range(18), True), 6: False}
