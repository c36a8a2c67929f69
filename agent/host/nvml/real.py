"""NVML through nvidia-ml-py: the only module that imports `pynvml`."""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Concatenate, ParamSpec, TypeVar

from agent.clock import SYSTEM_CLOCK, Clock
from agent.host.busid import BusIdError, normalize_bus_id
from agent.host.nvml.api import (
    _FUNCTION_NOT_FOUND,
    _GPU_IS_LOST,
    _NOT_SUPPORTED,
    _RESET_REQUIRED,
    GpuLostError,
    GpuState,
    MemoryHealth,
    MigInfo,
    NvmlError,
    NvmlEventSet,
    NvmlFacts,
    NvmlInventory,
    NvmlUnavailableError,
    _code,
    _text,
)
from agent.host.nvml.gate import SessionGate
from agent.host.nvml.real_events import RealEventSet
from agent.host.nvml.real_facts import read_facts
from agent.host.nvml.real_inventory import read_inventory
from agent.host.nvml.real_mig import read_mig_devices
from agent.host.nvml.real_state import read_fabric, read_nvlinks, read_recovery_action

log = logging.getLogger(__name__)
_RETRY_INIT_SECONDS = 60.0  # a failed nvmlInit is tried again this long after (health recovers with the driver)
# The process lists a reset must wait for, by versioned name: _v3 first, _v2 for a driver older than that call
# (NVML_ERROR_FUNCTION_NOT_FOUND). Not the unversioned wrappers: on such a driver they raise
# NVMLLibraryMismatchError instead of falling back.
_PROCESS_CALLS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
                  "nvmlDeviceGetMPSComputeRunningProcesses")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _gated(method: Callable[Concatenate[RealNvml, _P], _R]) -> Callable[Concatenate[RealNvml, _P], _R]:
    """Run a public call with the shared session held (it waits while a GPU reset has the session closed)."""
    def call(nvml: RealNvml, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with nvml._gate.call():
            return method(nvml, *args, **kwargs)
    call.__doc__, call.__name__ = method.__doc__, method.__name__
    return call


class RealNvml:
    """NVML through nvidia-ml-py. Initialises lazily; a missing library or driver makes it unavailable."""

    def __init__(self, library: ModuleType | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._library = library
        self._clock = clock
        self._lock = threading.Lock()
        self._initialised: bool | None = None
        self._failed_at = 0.0
        self.unavailable_reason = ""
        self._handles: dict[str, Any] = {}
        self._unsupported_logged: set[tuple[str, str]] = set()
        self._gate = SessionGate()
        self._event_sets: list[RealEventSet] = []

    def _init(self) -> ModuleType | None:
        with self._lock:
            if self._initialised is False and self._clock.monotonic() - self._failed_at >= _RETRY_INIT_SECONDS:
                self._initialised = None  # the driver may be loaded by now: try again, so health can recover
            if self._initialised is None:
                try:
                    if self._library is None:
                        import pynvml  # type: ignore[import-untyped]

                        self._library = pynvml
                    self._library.nvmlInit()
                    self._initialised = True
                    if self.unavailable_reason:
                        log.info("NVML initialised after all (was: %s)", self.unavailable_reason)
                    self.unavailable_reason = ""
                except Exception as exc:  # pynvml raises NVMLError subclasses, or OSError for the library
                    self._initialised = False
                    self._failed_at = self._clock.monotonic()
                    reason, self.unavailable_reason = self.unavailable_reason, f"{type(exc).__name__}: {exc}"
                    if reason != self.unavailable_reason:
                        log.warning("NVML unavailable (%s); GPU identity and NVML health checks are off "
                                    "(initialisation is retried every %.0f s)", self.unavailable_reason,
                                    _RETRY_INIT_SECONDS)
            return self._library if self._initialised else None

    @property
    def available(self) -> bool:
        """True once NVML initialised."""
        with self._gate.call():
            return self._init() is not None

    @_gated
    def gpu_uuids(self) -> dict[str, str]:
        """UUID per canonical bus id; a GPU that errors (lost, not supported) is skipped with a warning."""
        nvml = self._init()
        if nvml is None:
            return {}
        found: dict[str, str] = {}
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return {}
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
                found[normalize_bus_id(bus_id)] = _text(nvml.nvmlDeviceGetUUID(handle))
            except nvml.NVMLError as exc:
                log.warning("NVML GPU %d skipped: %s", index, exc)
            except BusIdError as exc:
                log.warning("NVML GPU %d skipped: %s", index, exc)
        return found

    @_gated
    def _per_gpu(self, what: str, read: Any) -> dict[str, Any]:
        """`read(nvml, handle)` for every GPU by canonical bus id; a GPU that errors is skipped with a warning."""
        nvml = self._init()
        if nvml is None:
            return {}
        found: dict[str, Any] = {}
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            log.warning("NVML device count failed: %s", exc)
            return {}
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                bus_id = normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
                found[bus_id] = read(nvml, handle)
            except (nvml.NVMLError, BusIdError) as exc:
                if _code(exc) != _NOT_SUPPORTED:
                    log.warning("NVML GPU %d: no %s: %s", index, what, exc)
        return found

    def gpu_minors(self) -> dict[str, int]:
        """nvmlDeviceGetMinorNumber per GPU."""
        return self._per_gpu("minor number", lambda nvml, handle: int(nvml.nvmlDeviceGetMinorNumber(handle)))

    def mig_gpus(self) -> set[str]:
        """GPUs whose current MIG mode (nvmlDeviceGetMigMode) is enabled; GPUs without MIG are not."""
        modes = self._per_gpu("MIG mode", lambda nvml, handle: nvml.nvmlDeviceGetMigMode(handle)[0])
        return {bus_id for bus_id, current in modes.items() if current == 1}

    def mig_devices(self) -> dict[str, list[MigInfo]]:
        """The MIG devices of each GPU in MIG mode (`real_mig`); a GPU that errors is skipped with a warning."""
        def read(nvml: ModuleType, handle: Any) -> list[MigInfo]:
            return read_mig_devices(nvml, handle) if nvml.nvmlDeviceGetMigMode(handle)[0] == 1 else []
        return {bus_id: found for bus_id, found in self._per_gpu("MIG devices", read).items() if found}

    def _lib(self) -> ModuleType:
        nvml = self._init()
        if nvml is None:
            raise NvmlUnavailableError(self.unavailable_reason)
        return nvml

    def _translate(self, nvml: ModuleType, uuid: str, exc: BaseException) -> NvmlError:
        if _code(exc) in (_GPU_IS_LOST, _RESET_REQUIRED):
            self._handles.pop(uuid, None)
            return GpuLostError(uuid, str(exc))
        return NvmlError(f"{uuid}: {exc}")

    def _handle(self, nvml: ModuleType, uuid: str) -> Any:
        if uuid not in self._handles:
            try:
                self._handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
            except nvml.NVMLError as exc:
                raise self._translate(nvml, uuid, exc) from exc
        return self._handles[uuid]

    def _query(self, nvml: ModuleType, uuid: str, what: str, call: Any, *args: Any) -> Any:
        """One call; None when the GPU or driver does not support it (said once per GPU and call)."""
        try:
            return call(*args)
        except nvml.NVMLError as exc:
            if _code(exc) in (_NOT_SUPPORTED, _FUNCTION_NOT_FOUND):
                self._unsupported(uuid, what)
                return None
            raise self._translate(nvml, uuid, exc) from exc

    @_gated
    def memory_health(self, uuid: str) -> MemoryHealth:
        """ECC counts, retired pages and remapped rows of one GPU."""
        nvml = self._lib()
        h = self._handle(nvml, uuid)

        def ecc(error_type: int, counter: int) -> int | None:
            return self._query(nvml, uuid, "ECC counts", nvml.nvmlDeviceGetTotalEccErrors, h, error_type, counter)

        def retired(cause: int) -> int | None:
            pages = self._query(nvml, uuid, "retired pages", nvml.nvmlDeviceGetRetiredPages, h, cause)
            return None if pages is None else len(pages)

        pending = self._query(nvml, uuid, "retired-page status", nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
        rows = self._query(nvml, uuid, "remapped rows", nvml.nvmlDeviceGetRemappedRows, h)
        corr, unc, remap_pending, failure = rows if rows is not None else (None,) * 4
        return MemoryHealth(
            uuid, ecc(0, 0), ecc(1, 0), ecc(0, 1), ecc(1, 1), retired(0), retired(1),
            None if pending is None else bool(pending), corr, unc,
            None if remap_pending is None else bool(remap_pending), None if failure is None else bool(failure))

    @_gated
    def gpu_state(self, uuid: str) -> GpuState:
        """NVLink states, fabric info and the recovery-action field of one GPU; each part fails on its own."""
        nvml = self._lib()
        h = self._handle(nvml, uuid)
        errors: dict[str, str] = {}
        unsupported = functools.partial(self._unsupported, uuid)
        links = self._part(nvml, uuid, errors, "nvlink", lambda: read_nvlinks(nvml, uuid, h)) or {}
        fabric = self._part(nvml, uuid, errors, "fabric", lambda: read_fabric(nvml, h, unsupported))
        action = self._part(nvml, uuid, errors, "recovery_action",
                            lambda: read_recovery_action(nvml, uuid, h, unsupported))
        return GpuState(uuid, links, fabric, action, errors)

    def _part(self, nvml: ModuleType, uuid: str, errors: dict[str, str], part: str, read: Callable[[], Any]) -> Any:
        """One part of `gpu_state`: a lost GPU raises; any other failure is that part's error."""
        try:
            return read()
        except GpuLostError:
            self._handles.pop(uuid, None)  # a handle of a lost GPU is stale: the next call opens a fresh one
            raise
        except nvml.NVMLError as exc:
            translated = self._translate(nvml, uuid, exc)
            if isinstance(translated, GpuLostError):
                raise translated from exc
            errors[part] = str(exc)
        except NvmlError as exc:
            errors[part] = str(exc)
        except (AttributeError, TypeError, ValueError, ctypes.ArgumentError) as exc:  # a library too old or too
            # new for these calls: that part cannot be read (the check shows it), the others still can
            errors[part] = f"{type(exc).__name__}: {exc}"
        return None

    def _unsupported(self, uuid: str, what: str) -> None:
        if (uuid, what) not in self._unsupported_logged:
            self._unsupported_logged.add((uuid, what))
            log.info("NVML %s not supported on %s; that check is skipped", what, uuid)

    @_gated
    def inventory(self) -> NvmlInventory:
        """Versions, each GPU's basics and the calls this driver answers (agent.host.nvml.real_inventory)."""
        return read_inventory(self._lib())

    @_gated
    def facts(self) -> NvmlFacts:
        """What node labels describe, in one reading (agent.host.nvml.real_facts)."""
        return read_facts(self._lib())

    @_gated
    def open_events(self, uuids: Iterable[str]) -> NvmlEventSet:
        """Register Xid and ECC events (masked by what each GPU supports) on one event set."""
        events = RealEventSet(self, list(uuids))
        events.open()
        self._event_sets.append(events)
        return events

    @_gated
    def running_processes(self, uuid: str) -> list[int]:
        """PIDs of the compute, graphics and MPS processes on the GPU; a list the GPU does not support is empty."""
        nvml = self._lib()
        h = self._handle(nvml, uuid)
        pids: set[int] = set()
        for name in _PROCESS_CALLS:
            for call in (f"{name}_v3", f"{name}_v2"):
                if not hasattr(nvml, call):
                    continue
                try:
                    pids.update(int(p.pid) for p in getattr(nvml, call)(h))
                except nvml.NVMLError as exc:
                    if _code(exc) == _FUNCTION_NOT_FOUND:
                        continue  # a driver older than this struct version: the older call
                    if _code(exc) != _NOT_SUPPORTED:
                        raise self._translate(nvml, uuid, exc) from exc
                break
        return sorted(pids)

    def suspend(self, timeout_s: float) -> bool:
        """Close the session for a GPU reset: wait up to `timeout_s` for running calls, free the event sets, shut
        NVML down. Calls wait until `resume`. False (nothing closed) when the calls did not finish in time."""
        return self._gate.suspend(timeout_s, self._shutdown)

    def resume(self) -> None:
        """Open the session again (lazily, at the next call): handles and event sets are made afresh."""
        self._gate.resume()

    def _shutdown(self) -> None:
        with self._lock:
            for events in list(self._event_sets):
                events.release()
            self._handles.clear()
            if self._initialised and self._library is not None:
                try:
                    self._library.nvmlShutdown()
                except Exception as exc:  # the session is dropped either way: the next call initialises again
                    log.warning("NVML shutdown for a GPU reset failed: %s", exc)
            self._initialised = None

    # --- what an event set needs of its session (agent.host.nvml.real_events.SessionOwner) ---------------------

    @contextmanager
    def session_call(self) -> Iterator[None]:
        """Hold the shared session for one call."""
        with self._gate.call():
            yield

    def session_library(self) -> ModuleType:
        """The initialised library; NvmlUnavailableError otherwise."""
        return self._lib()

    def device_handle(self, nvml: ModuleType, uuid: str) -> Any:
        """The GPU's (cached) handle."""
        return self._handle(nvml, uuid)

    def forget_events(self, events: RealEventSet) -> None:
        """A closed event set is not freed again at a suspension."""
        with self._lock:
            self._event_sets = [e for e in self._event_sets if e is not events]
