"""NVML for simulated nodes, with fault injection (Xids, ECC, remaps, lost GPUs, unsupported calls)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from agent.host.busid import normalize_bus_id
from agent.host.nvml.api import (
    GpuLostError,
    MemoryHealth,
    NvmlError,
    NvmlEvent,
    NvmlEventSet,
    NvmlUnavailableError,
)


@dataclass
class _SimGpu:
    health: MemoryHealth
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # "ecc", "retired_pages", "remapped_rows", "events"


_ZERO: dict[str, Any] = {f.name: 0 for f in fields(MemoryHealth) if f.name != "uuid"} | {
    "retired_pages_pending": False, "remap_pending": False, "remap_failure": False}
_FIELD_GROUPS = {"ecc": ("ecc_",), "retired_pages": ("retired_",), "remapped_rows": ("remap",)}


class SimulatedNvml:
    """NVML for a simulated node: the profile's UUIDs, healthy GPUs, and methods that inject faults."""

    def __init__(self, uuids: Mapping[str, str], *, available: bool = True,
                 unavailable_reason: str = "NVMLError_LibraryNotFound: simulated", mig: Iterable[str] = ()) -> None:
        self._uuids = {normalize_bus_id(k): v for k, v in uuids.items()}
        self._mig = {normalize_bus_id(bus_id) for bus_id in mig}
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

    def set_available(self, available: bool, reason: str = "NVMLError_DriverNotLoaded: simulated") -> None:
        """Make NVML fail to initialise (a driver reload, a broken library) or come back."""
        self._available = available
        self._reason = "" if available else reason

    def gpu_uuids(self) -> dict[str, str]:
        """The profile's UUIDs."""
        return dict(self._uuids) if self._available else {}

    def gpu_minors(self) -> dict[str, int]:
        """Minors in bus-id order, as the driver numbers GPUs it probes in that order."""
        return {bus_id: minor for minor, bus_id in enumerate(sorted(self._uuids))} if self._available else {}

    def mig_gpus(self) -> set[str]:
        """The GPUs built with MIG mode on."""
        return set(self._mig) if self._available else set()

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
            return replace(gpu.health, **hidden)  # type: ignore[arg-type]  # only the Optional fields are named

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
            self._gpus[uuid].health = replace(self._gpus[uuid].health, **values)  # type: ignore[arg-type]

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
