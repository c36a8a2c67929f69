"""A stand-in for libnvidia-ml.so.1 under the real `pynvml` wrappers, for machines without an NVIDIA driver.

`pynvml` resolves every C function through `_nvmlGetFunctionPointer`, which consults a cache before the loaded
library. `StandInLibNvml` puts ctypes callbacks with the C signatures (from NVML's headers as nvidia-ml-py
13.615.71 calls them) into that cache and marks the library loaded, so `RealNvml` runs unchanged over the real
wrappers: struct versions, `byref` arguments, per-field return codes and error classes are the real ones. The
answers follow NVML's documented behaviour: a link the GPU does not have is NVML_ERROR_NOT_SUPPORTED or
NVML_ERROR_INVALID_ARGUMENT, `nvmlDeviceGetFieldValues` succeeds and reports per field (link-state fields scoped
by link in `scopeId`), a lost GPU is NVML_ERROR_GPU_IS_LOST. Not modelled: anything the agent does not call here.

Sessions and event sets follow NVML's lifetime rules as far as a GPU reset needs them: `sessions` counts
nvmlInit minus nvmlShutdown, a call with no session open answers NVML_ERROR_UNINITIALIZED, event sets live in
the session that made them (a set from a closed session answers UNINITIALIZED), and `holders()` says whether
anything would still hold the GPUs' device nodes (what makes `nvidia-smi --gpu-reset` refuse). Process lists
answer with the size-query protocol of the _v3 calls (the _v2 ones when `old_driver`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator
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
    processes: list[int] = field(default_factory=list)  # compute processes (PIDs)
    graphics: list[int] = field(default_factory=list)
    mps: list[int] = field(default_factory=list)
    sleeping: set[int] = field(default_factory=set)  # links in NVML_NVLINK_STATE_SLEEP (the field tells; the call
    # nvmlDeviceGetNvLinkState is assumed to say DISABLED for them [unconfirmed])
    bus_id: str = "00000000:1B:00.0"  # as nvmlDeviceGetPciInfo writes busId
    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 81559 << 20  # bytes
    compute: tuple[int, int] = (9, 0)
    mig_mode: int | None = 0  # current MIG mode; None: NOT_SUPPORTED (a GPU without MIG)
    cluster_uuid: bytes = bytes(16)  # fabric cluster UUID (zero: not attached to a multi-node fabric)
    clique_id: int = 0


class StandInLibNvml:
    """Callbacks for the C functions `RealNvml` uses; `install()` puts them under the real `pynvml`."""

    def __init__(self, gpus: list[StandInGpu], *, old_driver: bool = False) -> None:
        self.gpus = gpus
        self.calls = 0
        self.driver_version = "570.124.06"
        self.sessions = 0
        self.epoch = 0  # grows when the last session closes: what belonged to it is gone
        self.event_sets: dict[int, tuple[int, set[int]]] = {}  # set id -> (epoch, registered GPU indexes)
        self.in_call: Callable[[], None] = lambda: None  # runs inside every device call (to hold one open)
        self._queued: list[tuple[int, int, int]] = []  # (set id, GPU index, Xid)
        self._cond = threading.Condition()
        self._next_set = 100
        proto = ctypes.CFUNCTYPE
        procs = proto(ctypes.c_int, _VP, ctypes.POINTER(ctypes.c_uint), _VP)
        version = "_v2" if old_driver else "_v3"
        self._functions: dict[str, Any] = {
            "nvmlInitWithFlags": proto(ctypes.c_int, ctypes.c_uint)(self._init),
            "nvmlShutdown": proto(ctypes.c_int)(self._shutdown),
            f"nvmlDeviceGetComputeRunningProcesses{version}": procs(self._processes("processes")),
            f"nvmlDeviceGetGraphicsRunningProcesses{version}": procs(self._processes("graphics")),
            f"nvmlDeviceGetMPSComputeRunningProcesses{version}": procs(self._processes("mps")),
            "nvmlEventSetCreate": proto(ctypes.c_int, _VP)(self._set_create),
            "nvmlDeviceGetSupportedEventTypes": proto(ctypes.c_int, _VP, ctypes.POINTER(ctypes.c_ulonglong))(
                self._supported_events),
            "nvmlDeviceRegisterEvents": proto(ctypes.c_int, _VP, ctypes.c_ulonglong, _VP)(self._register),
            "nvmlEventSetWait_v2": proto(ctypes.c_int, _VP, ctypes.POINTER(pynvml.c_nvmlEventData_t),
                                         ctypes.c_uint)(self._set_wait),
            "nvmlEventSetFree": proto(ctypes.c_int, _VP)(self._set_free),
            "nvmlDeviceGetUUID": proto(ctypes.c_int, _VP, _VP, ctypes.c_uint)(self._uuid),
            "nvmlDeviceGetHandleByUUID": proto(ctypes.c_int, ctypes.c_char_p, _VP)(self._handle),
            # the inventory (`gpu-node-agent doctor`): count, handle by index, names, driver version
            "nvmlDeviceGetCount_v2": proto(ctypes.c_int, ctypes.POINTER(ctypes.c_uint))(self._count),
            "nvmlDeviceGetHandleByIndex_v2": proto(ctypes.c_int, ctypes.c_uint, _VP)(self._handle_by_index),
            "nvmlDeviceGetName": proto(ctypes.c_int, _VP, _VP, ctypes.c_uint)(self._name),
            "nvmlSystemGetDriverVersion": proto(ctypes.c_int, _VP, ctypes.c_uint)(self._driver_version),
            "nvmlDeviceGetNvLinkState": proto(ctypes.c_int, _VP, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint))(
                self._link_state),
            "nvmlDeviceGetGpuFabricInfoV": proto(ctypes.c_int, _VP, ctypes.POINTER(
                pynvml.c_nvmlGpuFabricInfo_v3_t))(self._fabric),
            "nvmlDeviceGetFieldValues": proto(ctypes.c_int, _VP, ctypes.c_int32, _VP)(self._field_values),
            # node-label facts: CUDA version, PCI bus id, memory, compute capability, MIG mode
            "nvmlSystemGetCudaDriverVersion": proto(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(self._cuda_version),
            "nvmlDeviceGetPciInfo_v3": proto(ctypes.c_int, _VP, ctypes.POINTER(pynvml.nvmlPciInfo_t))(self._pci),
            "nvmlDeviceGetMemoryInfo": proto(ctypes.c_int, _VP, ctypes.POINTER(pynvml.c_nvmlMemory_t))(self._memory),
            "nvmlDeviceGetCudaComputeCapability": proto(ctypes.c_int, _VP, ctypes.POINTER(ctypes.c_int),
                                                        ctypes.POINTER(ctypes.c_int))(self._compute),
            "nvmlDeviceGetMigMode": proto(ctypes.c_int, _VP, ctypes.POINTER(ctypes.c_uint),
                                          ctypes.POINTER(ctypes.c_uint))(self._mig_mode),
        }
        self.cuda_version = 12080

    # --- sessions, processes and events -------------------------------------------------------------------

    def _init(self, flags: int) -> int:
        self.sessions += 1
        return pynvml.NVML_SUCCESS

    def _shutdown(self) -> int:
        if self.sessions == 0:
            return pynvml.NVML_ERROR_UNINITIALIZED
        self.sessions -= 1
        if self.sessions == 0:
            self.epoch += 1
        return pynvml.NVML_SUCCESS

    def holders(self) -> list[str]:
        """What would keep a reset from running: open sessions, live event sets."""
        live = [f"event set {i}" for i, (epoch, _) in self.event_sets.items() if epoch == self.epoch]
        return ([f"{self.sessions} NVML session(s)"] if self.sessions else []) + live

    def _processes(self, kind: str) -> Callable[[int | None, Any, int | None], int]:
        def answer(handle: int | None, count: Any, infos: int | None) -> int:
            self.calls += 1
            self.in_call()
            gpu = self._gpu(handle)
            if gpu is None or not self.sessions:
                return pynvml.NVML_ERROR_UNINITIALIZED if gpu else pynvml.NVML_ERROR_INVALID_ARGUMENT
            pids: list[int] = getattr(gpu, kind)
            if not pids:
                count[0] = 0
                return pynvml.NVML_SUCCESS
            if infos is None or count[0] < len(pids):
                count[0] = len(pids)
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            out = ctypes.cast(infos, ctypes.POINTER(pynvml.c_nvmlProcessInfo_v2_t))
            for i, pid in enumerate(pids):
                out[i].pid, out[i].usedGpuMemory = pid, 1 << 30
            count[0] = len(pids)
            return pynvml.NVML_SUCCESS
        return answer

    def _set_create(self, out: int | None) -> int:
        if not self.sessions:
            return pynvml.NVML_ERROR_UNINITIALIZED
        self._next_set += 1
        self.event_sets[self._next_set] = (self.epoch, set())
        ctypes.cast(out, ctypes.POINTER(_VP))[0] = self._next_set
        return pynvml.NVML_SUCCESS

    def _live_set(self, handle: int | None) -> set[int] | None:
        entry = self.event_sets.get(handle or 0)
        return entry[1] if entry is not None and entry[0] == self.epoch and self.sessions else None

    def _supported_events(self, handle: int | None, out: Any) -> int:
        out[0] = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
        return pynvml.NVML_SUCCESS if self._gpu(handle) else pynvml.NVML_ERROR_INVALID_ARGUMENT

    def _register(self, handle: int | None, types: int, event_set: int | None) -> int:
        registered = self._live_set(event_set)
        if registered is None:
            return pynvml.NVML_ERROR_UNINITIALIZED
        registered.add((handle or 0) - 1)
        return pynvml.NVML_SUCCESS

    def inject_xid(self, uuid: str, xid: int) -> None:
        """The driver reports an Xid on this GPU: every live set that registered it gets the event."""
        index = next(i for i, gpu in enumerate(self.gpus) if gpu.uuid == uuid)
        with self._cond:
            for set_id, (epoch, registered) in self.event_sets.items():
                if epoch == self.epoch and index in registered:
                    self._queued.append((set_id, index, xid))
            self._cond.notify_all()

    def _set_wait(self, event_set: int | None, data: Any, timeout_ms: int) -> int:
        self.in_call()
        if self._live_set(event_set) is None:
            return pynvml.NVML_ERROR_UNINITIALIZED
        with self._cond:
            mine = lambda: [q for q in self._queued if q[0] == event_set]  # noqa: E731
            if not self._cond.wait_for(lambda: bool(mine()), timeout_ms / 1000):
                return pynvml.NVML_ERROR_TIMEOUT
            found = mine()[0]
            self._queued.remove(found)
        out = data.contents
        out.device = ctypes.cast(found[1] + 1, pynvml.c_nvmlDevice_t)
        out.eventType, out.eventData = pynvml.nvmlEventTypeXidCriticalError, found[2]
        out.gpuInstanceId = out.computeInstanceId = 0xFFFFFFFF
        return pynvml.NVML_SUCCESS

    def _set_free(self, event_set: int | None) -> int:
        entry = self.event_sets.pop(event_set or 0, None)
        return pynvml.NVML_SUCCESS if entry is not None and entry[0] == self.epoch else \
            pynvml.NVML_ERROR_UNINITIALIZED

    def _uuid(self, handle: int | None, out: int | None, size: int) -> int:
        gpu = self._gpu(handle)
        if gpu is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        ctypes.memmove(out, gpu.uuid.encode() + b"\0", len(gpu.uuid) + 1)
        return pynvml.NVML_SUCCESS

    def _count(self, out: Any) -> int:
        if not self.sessions:
            return pynvml.NVML_ERROR_UNINITIALIZED
        out[0] = len(self.gpus)
        return pynvml.NVML_SUCCESS

    def _handle_by_index(self, index: int, out: int | None) -> int:
        if not self.sessions:
            return pynvml.NVML_ERROR_UNINITIALIZED
        if index >= len(self.gpus):
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        ctypes.cast(out, ctypes.POINTER(_VP))[0] = index + 1
        return pynvml.NVML_ERROR_GPU_IS_LOST if self.gpus[index].lost else pynvml.NVML_SUCCESS

    def _name(self, handle: int | None, out: int | None, size: int) -> int:
        if self._gpu(handle) is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        name = self._gpu(handle).name.encode()  # type: ignore[union-attr]
        ctypes.memmove(out, name + b"\0", len(name) + 1)
        return pynvml.NVML_SUCCESS

    def _driver_version(self, out: int | None, size: int) -> int:
        ctypes.memmove(out, self.driver_version.encode() + b"\0", len(self.driver_version) + 1)
        return pynvml.NVML_SUCCESS

    def _cuda_version(self, out: Any) -> int:
        out[0] = self.cuda_version
        return pynvml.NVML_SUCCESS

    def _answering(self, handle: int | None) -> tuple[StandInGpu | None, int]:
        gpu = self._gpu(handle)
        if gpu is None:
            return None, pynvml.NVML_ERROR_INVALID_ARGUMENT
        return (None, pynvml.NVML_ERROR_GPU_IS_LOST) if gpu.lost else (gpu, pynvml.NVML_SUCCESS)

    def _pci(self, handle: int | None, info: Any) -> int:
        gpu, code = self._answering(handle)
        if gpu is not None:
            info.contents.busId = gpu.bus_id.encode()
        return code

    def _memory(self, handle: int | None, info: Any) -> int:
        gpu, code = self._answering(handle)
        if gpu is not None:
            info.contents.total, info.contents.free, info.contents.used = gpu.memory_total, gpu.memory_total, 0
        return code

    def _compute(self, handle: int | None, major: Any, minor: Any) -> int:
        gpu, code = self._answering(handle)
        if gpu is not None:
            major[0], minor[0] = gpu.compute
        return code

    def _mig_mode(self, handle: int | None, current: Any, pending: Any) -> int:
        gpu, code = self._answering(handle)
        if gpu is None:
            return code
        if gpu.mig_mode is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        current[0] = pending[0] = gpu.mig_mode
        return pynvml.NVML_SUCCESS

    def _gpu(self, handle: int | None) -> StandInGpu | None:
        index = (handle or 0) - 1
        return self.gpus[index] if 0 <= index < len(self.gpus) else None

    def _handle(self, uuid: bytes, out: int | None) -> int:
        self.calls += 1
        self.in_call()
        if not self.sessions:
            return pynvml.NVML_ERROR_UNINITIALIZED
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
        out.clusterUuid[:] = list(gpu.cluster_uuid)
        out.cliqueId = gpu.clique_id
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
        saved_cache, saved_lib, saved_refs = dict(cache), pynvml.nvmlLib, pynvml._nvmlLib_refcount
        cache.update(self._functions)
        pynvml.nvmlLib = object()  # "loaded": anything not registered above answers FUNCTION_NOT_FOUND
        try:
            yield self
        finally:
            cache.clear()
            cache.update(saved_cache)
            pynvml.nvmlLib = saved_lib
            pynvml._nvmlLib_refcount = saved_refs
