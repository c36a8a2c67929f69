"""The NVML port: the only module that imports `pynvml` (nvidia-ml-py).

`RealNvml` talks to the driver; `SimulatedNvml` answers for a simulated profile and takes injected faults (Xids,
ECC errors, row remaps, lost GPUs, unsupported calls) for tests and demos. Both share the small `Nvml`
protocol, and `NvmlHealth` adds what the health checks need: an event set (Xid, single/double-bit ECC) and
one memory-health poll per GPU. A node without the NVIDIA driver is normal (CPU nodes, tests, laptops): NVML
then reports itself unavailable, once, and the rest of the agent carries on.

NVML errors are translated here (by return code, never by message text): a lost GPU (or one that needs a
reset) is `GpuLostError`; a call the GPU or driver does not support leaves its field None; anything else is
`NvmlError`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import ModuleType
from typing import Any, Protocol

from agent.topology.model import BusIdError, normalize_bus_id

log = logging.getLogger(__name__)

_GPU_IS_LOST, _NOT_SUPPORTED, _TIMEOUT, _FUNCTION_NOT_FOUND, _RESET_REQUIRED = 15, 3, 10, 13, 16
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


class Nvml(Protocol):
    """What the agent asks of NVML."""

    @property
    def available(self) -> bool:
        """True once NVML initialised."""

    def gpu_uuids(self) -> dict[str, str]:
        """GPU UUIDs keyed by canonical bus id (`0000:3b:00.0`); empty when NVML is unavailable."""


class NvmlEventSet(Protocol):
    """Registered Xid/ECC events of some GPUs. `wait` and `close` belong to one (blocking) thread."""

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        """Events that arrived, or [] after the timeout. GpuLostError is reported as "lost" events."""

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


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class RealNvml:
    """NVML through nvidia-ml-py. Initialises lazily; a missing library or driver makes it unavailable."""

    def __init__(self, library: ModuleType | None = None) -> None:
        self._library = library
        self._lock = threading.Lock()
        self._initialised: bool | None = None
        self.unavailable_reason = ""
        self._handles: dict[str, Any] = {}
        self._unsupported_logged: set[tuple[str, str]] = set()

    def _init(self) -> ModuleType | None:
        with self._lock:
            if self._initialised is None:
                try:
                    if self._library is None:
                        import pynvml

                        self._library = pynvml
                    self._library.nvmlInit()
                    self._initialised = True
                except Exception as exc:  # pynvml raises NVMLError subclasses, or OSError for the library
                    self._initialised = False
                    self.unavailable_reason = f"{type(exc).__name__}: {exc}"
                    log.warning("NVML unavailable (%s); GPU identity and NVML health checks are off",
                                self.unavailable_reason)
            return self._library if self._initialised else None

    @property
    def available(self) -> bool:
        """True once NVML initialised."""
        return self._init() is not None

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
                if (uuid, what) not in self._unsupported_logged:
                    self._unsupported_logged.add((uuid, what))
                    log.info("NVML %s not supported on %s; that check is skipped", what, uuid)
                return None
            raise self._translate(nvml, uuid, exc) from exc

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

    def open_events(self, uuids: Iterable[str]) -> NvmlEventSet:
        """Register Xid and ECC events (masked by what each GPU supports) on one event set."""
        nvml = self._lib()
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            raise NvmlError(f"cannot create an NVML event set: {exc}") from exc
        events = _RealEventSet(self, nvml, event_set)
        for uuid in uuids:
            try:
                handle = self._handle(nvml, uuid)
                mask = (_XID | _SBE | _DBE) & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                events.handles[uuid] = handle
            except GpuLostError:
                events.pending.append(NvmlEvent("lost", uuid))
            except nvml.NVMLError as exc:
                if _code(exc) in (_GPU_IS_LOST, _RESET_REQUIRED):
                    events.pending.append(NvmlEvent("lost", uuid))
                else:
                    log.warning("NVML events not available for %s (%s); polling still covers it", uuid, exc)
        return events


class _RealEventSet:
    def __init__(self, owner: RealNvml, nvml: ModuleType, event_set: Any) -> None:
        self._owner, self._nvml, self._set = owner, nvml, event_set
        self.handles: dict[str, Any] = {}
        self.pending: list[NvmlEvent] = []
        self._lost: set[str] = set()

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        nvml = self._nvml
        if self.pending:
            found, self.pending = self.pending, []
            return found
        try:
            data = nvml.nvmlEventSetWait_v2(self._set, max(1, int(timeout_s * 1000)))
        except nvml.NVMLError as exc:
            if _code(exc) == _TIMEOUT:
                return []
            if _code(exc) == _GPU_IS_LOST:
                return self._find_lost(exc)
            raise NvmlError(f"NVML event wait failed: {exc}") from exc
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError as exc:
            raise NvmlError(f"NVML event for an unknown GPU: {exc}") from exc
        instance = getattr(data, "gpuInstanceId", _NO_INSTANCE)
        if data.eventType & _XID:
            return [NvmlEvent("xid", uuid, int(data.eventData), None if instance == _NO_INSTANCE else instance)]
        return [NvmlEvent("dbe" if data.eventType & _DBE else "sbe", uuid)] if data.eventType & (_SBE | _DBE) \
            else []

    def _find_lost(self, exc: BaseException) -> list[NvmlEvent]:
        """The wait says a GPU is lost but not which: ask each one."""
        nvml, found = self._nvml, []
        for uuid, handle in self.handles.items():
            try:
                nvml.nvmlDeviceGetTemperature(handle, 0)
            except nvml.NVMLError as probe:
                if _code(probe) in (_GPU_IS_LOST, _RESET_REQUIRED) and uuid not in self._lost:
                    self._lost.add(uuid)
                    found.append(NvmlEvent("lost", uuid))
        if not found:
            raise NvmlError(f"NVML event wait: {exc}") from exc
        return found

    def close(self) -> None:
        try:
            self._nvml.nvmlEventSetFree(self._set)
        except self._nvml.NVMLError as exc:
            log.debug("NVML event set free failed: %s", exc)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class _SimGpu:
    health: MemoryHealth
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # "ecc", "retired_pages", "remapped_rows", "events"


_ZERO = {f.name: 0 for f in fields(MemoryHealth) if f.name != "uuid"} | {
    "retired_pages_pending": False, "remap_pending": False, "remap_failure": False}
_FIELD_GROUPS = {"ecc": ("ecc_",), "retired_pages": ("retired_",), "remapped_rows": ("remap",)}


class SimulatedNvml:
    """NVML for a simulated node: the profile's UUIDs, healthy GPUs, and methods that inject faults."""

    def __init__(self, uuids: Mapping[str, str], *, available: bool = True,
                 unavailable_reason: str = "NVMLError_LibraryNotFound: simulated") -> None:
        self._uuids = {normalize_bus_id(k): v for k, v in uuids.items()}
        self._available = available
        self._reason = "" if available else unavailable_reason
        self._lock = threading.Lock()
        self._gpus = {u: _SimGpu(MemoryHealth(u, **_ZERO)) for u in self._uuids.values()}
        self._listeners: list[tuple[frozenset[str], queue.SimpleQueue[NvmlEvent]]] = []

    @property
    def available(self) -> bool:
        """False only when built with available=False (a node without the driver)."""
        return self._available

    @property
    def unavailable_reason(self) -> str:
        """Why NVML is unavailable."""
        return self._reason

    def gpu_uuids(self) -> dict[str, str]:
        """The profile's UUIDs."""
        return dict(self._uuids) if self._available else {}

    def open_events(self, uuids: Iterable[str]) -> NvmlEventSet:
        """An event set fed by the inject_* methods."""
        if not self._available:
            raise NvmlUnavailableError(self._reason)
        with self._lock:
            watched = frozenset(u for u in uuids if u in self._gpus and "events" not in self._gpus[u].unsupported)
            events: queue.SimpleQueue[NvmlEvent] = queue.SimpleQueue()
            for uuid in sorted(watched):
                if self._gpus[uuid].lost:
                    events.put(NvmlEvent("lost", uuid))
            self._listeners.append((watched, events))
        return _SimEventSet(events, lambda: self._drop(events))

    def _drop(self, events: queue.SimpleQueue[NvmlEvent]) -> None:
        with self._lock:
            self._listeners = [(w, q) for w, q in self._listeners if q is not events]

    def memory_health(self, uuid: str) -> MemoryHealth:
        """The GPU's simulated counters; None for groups marked unsupported."""
        if not self._available:
            raise NvmlUnavailableError(self._reason)
        with self._lock:
            gpu = self._gpus.get(uuid)
            if gpu is None:
                raise NvmlError(f"{uuid}: no such GPU")
            if gpu.lost:
                raise GpuLostError(uuid, "GPU is lost")
            hidden = {f.name: None for f in fields(MemoryHealth) for group in gpu.unsupported
                      for prefix in _FIELD_GROUPS.get(group, ()) if f.name.startswith(prefix)}
            return replace(gpu.health, **hidden)

    def _emit(self, event: NvmlEvent) -> None:
        for watched, events in self._listeners:
            if event.uuid in watched:
                events.put(event)

    def inject_xid(self, uuid: str, code: int, gpu_instance: int | None = None) -> None:
        """The driver reports Xid `code` on this GPU."""
        with self._lock:
            self._emit(NvmlEvent("xid", uuid, code, gpu_instance))

    def inject_ecc(self, uuid: str, corrected: int = 0, uncorrected: int = 0) -> None:
        """ECC errors: counters grow (volatile and aggregate) and sbe/dbe events fire."""
        with self._lock:
            h = self._gpus[uuid].health
            self._gpus[uuid].health = replace(
                h, ecc_corrected_volatile=(h.ecc_corrected_volatile or 0) + corrected,
                ecc_corrected_aggregate=(h.ecc_corrected_aggregate or 0) + corrected,
                ecc_uncorrected_volatile=(h.ecc_uncorrected_volatile or 0) + uncorrected,
                ecc_uncorrected_aggregate=(h.ecc_uncorrected_aggregate or 0) + uncorrected)
            for kind, count in (("sbe", corrected), ("dbe", uncorrected)):
                if count:
                    self._emit(NvmlEvent(kind, uuid))

    def set_memory(self, uuid: str, **values: int | bool) -> None:
        """Set MemoryHealth fields directly, e.g. remap_pending=True, retired_pages_pending=True."""
        with self._lock:
            self._gpus[uuid].health = replace(self._gpus[uuid].health, **values)

    def set_unsupported(self, uuid: str, *groups: str) -> None:
        """Make call groups unsupported on this GPU: ecc, retired_pages, remapped_rows, events."""
        with self._lock:
            self._gpus[uuid].unsupported = set(groups)

    def lose_gpu(self, uuid: str) -> None:
        """The GPU falls off the bus: polls raise GpuLostError, event sets report "lost"."""
        with self._lock:
            if not self._gpus[uuid].lost:
                self._gpus[uuid].lost = True
                self._emit(NvmlEvent("lost", uuid))

    def reset_gpu(self, uuid: str) -> None:
        """A GPU reset: it answers again, volatile ECC counts are zero, pending remaps and retirements apply."""
        with self._lock:
            gpu = self._gpus[uuid]
            gpu.lost = False
            gpu.health = replace(gpu.health, ecc_corrected_volatile=0, ecc_uncorrected_volatile=0,
                                  retired_pages_pending=False, remap_pending=False)


class _SimEventSet:
    def __init__(self, events: queue.SimpleQueue[NvmlEvent], on_close: Any) -> None:
        self._events, self._on_close = events, on_close

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        try:
            found = [self._events.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                found.append(self._events.get_nowait())
            except queue.Empty:
                return found

    def close(self) -> None:
        self._on_close()
