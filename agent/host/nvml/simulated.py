"""NVML for simulated nodes, with fault injection (Xids, ECC, remaps, lost GPUs, unsupported calls, NVLink and
fabric state, the driver's recovery action).

NVLink, fabric and recovery-action faults can also be injected from outside the process (`run --simulate`): a
JSON file `<overrides_dir>/<GPU UUID>.json` is read on every `gpu_state` call, e.g.
`{"nvlink_inactive": [3, 7], "fabric": {"state": "in_progress"}, "recovery_action": "gpu_reset"}`; deleting it
clears them. `<overrides_dir>/driver.json` with `{"unavailable": "<why>"}` makes the whole library unavailable
(a driver unloaded, a broken install) until it is deleted.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from agent.host.busid import normalize_bus_id
from agent.host.nvml.api import (
    FABRIC_COMPLETED,
    FABRIC_NOT_SUPPORTED,
    FABRIC_STATES,
    RECOVERY_ACTIONS,
    GpuFabric,
    GpuFacts,
    GpuInfo,
    GpuLostError,
    GpuState,
    MemoryHealth,
    MigFacts,
    MigInfo,
    NvmlError,
    NvmlEvent,
    NvmlEventSet,
    NvmlFacts,
    NvmlInventory,
    NvmlUnavailableError,
)
from agent.host.nvml.gate import SessionGate
from agent.host.nvml.simulated_driver import SimDriver


@dataclass
class _SimGpu:
    health: MemoryHealth
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)  # ecc, retired_pages, remapped_rows, events, STATE_PARTS
    nvlinks: dict[int, bool] = field(default_factory=dict)
    fabric: GpuFabric | None = None
    recovery_action: int = 0
    failing: dict[str, str] = field(default_factory=dict)  # gpu_state part -> error
    processes: list[int] = field(default_factory=list)  # PIDs using the GPU


STATE_PARTS = ("nvlink", "fabric", "recovery_action")


_ZERO: dict[str, Any] = {f.name: 0 for f in fields(MemoryHealth) if f.name != "uuid"} | {
    "retired_pages_pending": False, "remap_pending": False, "remap_failure": False}
_FIELD_GROUPS = {"ecc": ("ecc_",), "retired_pages": ("retired_",), "remapped_rows": ("remap",)}


class SimulatedNvml:
    """NVML for a simulated node: the profile's UUIDs, healthy GPUs, and methods that inject faults."""

    def __init__(self, uuids: Mapping[str, str], *, available: bool = True,
                 unavailable_reason: str = "NVMLError_LibraryNotFound: simulated", mig: Iterable[str] = (),
                 nvlinks: int = 0, fabric: bool = False, overrides_dir: Path | None = None,
                 mig_devices: Mapping[str, Iterable[MigInfo]] | None = None, driver: SimDriver | None = None
                 ) -> None:
        """`nvlinks` active links per GPU (0: a PCIe board); `fabric`: an NVSwitch system whose fabric probe has
        completed; `overrides_dir`: where `<uuid>.json` override files are read (module docstring); `mig`: GPUs in
        MIG mode, and `mig_devices` their MIG devices by bus id (a GPU named there is in MIG mode too)."""
        self._uuids = {normalize_bus_id(k): v for k, v in uuids.items()}
        self._mig_devices = {normalize_bus_id(k): list(v) for k, v in (mig_devices or {}).items()}
        self._mig = {normalize_bus_id(bus_id) for bus_id in mig} | set(self._mig_devices)
        self._available = available
        self._reason = "" if available else unavailable_reason
        self._lock = threading.Lock()
        self.overrides_dir = overrides_dir
        self._gpus = {u: _SimGpu(MemoryHealth(u, **_ZERO), nvlinks=dict.fromkeys(range(nvlinks), True),
                                 fabric=GpuFabric(FABRIC_COMPLETED) if fabric else None)
                      for u in self._uuids.values()}
        self._listeners: list[tuple[frozenset[str], queue.SimpleQueue[NvmlEvent | None]]] = []
        self._gate = SessionGate()
        self.suspensions = 0  # sessions closed for a GPU reset
        self.driver = driver or SimDriver()
        self._facts_failure = ""

    @property
    def available(self) -> bool:
        """False when built with available=False (a node without the driver), after `set_available(False)`, or
        while `<overrides_dir>/driver.json` says `{"unavailable": "<why>"}` (a driver unloaded from outside)."""
        return self._available and not self._driver_down()

    def _driver_down(self) -> str:
        path = self.overrides_dir / "driver.json" if self.overrides_dir is not None else None
        if path is None or not path.is_file():
            return ""
        try:
            return str(json.loads(path.read_text(encoding="utf-8")).get("unavailable") or "")
        except (OSError, ValueError, AttributeError) as exc:
            return f"simulated override {path} unreadable: {exc}"

    @property
    def unavailable_reason(self) -> str:
        """Why NVML is unavailable."""
        return self._reason or self._driver_down()

    def set_available(self, available: bool, reason: str = "NVMLError_DriverNotLoaded: simulated") -> None:
        """Make NVML fail to initialise (a driver reload, a broken library) or come back."""
        self._available = available
        self._reason = "" if available else reason

    def gpu_uuids(self) -> dict[str, str]:
        """The profile's UUIDs."""
        return dict(self._uuids) if self.available else {}

    def gpu_minors(self) -> dict[str, int]:
        """Minors in bus-id order, as the driver numbers GPUs it probes in that order."""
        return {bus_id: minor for minor, bus_id in enumerate(sorted(self._uuids))} if self.available else {}

    def mig_gpus(self) -> set[str]:
        """The GPUs built with MIG mode on."""
        return set(self._mig) if self.available else set()

    def inventory(self) -> NvmlInventory:
        """A simulated driver: every GPU in bus-id order, each call supported unless marked unsupported on the
        first GPU."""
        if not self.available:
            raise NvmlUnavailableError(self.unavailable_reason)
        with self._lock:
            models = self.driver.models
            gpus = tuple(GpuInfo(index, models[bus_id].name if bus_id in models else "simulated GPU",
                                 self._uuids[bus_id], bus_id, bus_id in self._mig, True, True)
                         for index, bus_id in enumerate(sorted(self._uuids)))
            first = self._gpus[gpus[0].uuid] if gpus else None
        off = first.unsupported if first is not None else set()
        support = {"nvlink_state_field": "no" if "nvlink" in off else "yes",
                   "recovery_action_field": "no" if "recovery_action" in off else "yes",
                   "fabric_info": "no" if "fabric" in off else "v3",
                   "remapped_rows": "no" if "remapped_rows" in off else "yes",
                   "process_list": "v3", "event_set": "no" if "events" in off else "yes"} if first else {}
        cuda = self.driver.cuda_version
        return NvmlInventory(self.driver.version, "simulated", f"{cuda // 1000}.{cuda % 1000 // 10}", gpus, support)

    def fail_facts(self, why: str = "NVMLError_Unknown: simulated") -> None:
        """Make `facts` fail (a driver query erroring while NVML stays up); an empty `why` heals it."""
        self._facts_failure = why

    def facts(self) -> NvmlFacts:
        """The driver's and each GPU's facts from `driver`; NvmlError for a GPU whose model or MIG profile the
        simulated driver does not describe (no invented figures), or while `fail_facts` is set."""
        if not self.available:
            raise NvmlUnavailableError(self.unavailable_reason)
        if self._facts_failure:
            raise NvmlError(self._facts_failure)
        gpus: list[GpuFacts] = []
        with self._gate.call(), self._lock:
            for bus_id in sorted(self._uuids):
                uuid, model = self._uuids[bus_id], self.driver.models.get(bus_id)
                if model is None:
                    raise NvmlError(f"simulated driver: no GPU model for {bus_id}")
                if self._gpus[uuid].lost:
                    raise GpuLostError(uuid, "GPU is lost")
                migs = tuple(self._mig_facts(m) for m in self._mig_devices.get(bus_id, ()))
                gpus.append(GpuFacts(uuid, bus_id, model.name, model.memory_mib, model.compute_capability,
                                     model.mig_capable, bus_id in self._mig, migs))
        return NvmlFacts(self.driver.version, self.driver.cuda_version, tuple(gpus))

    def _mig_facts(self, mig: MigInfo) -> MigFacts:
        known = self.driver.mig_profiles.get(mig.profile)
        if known is None:
            raise NvmlError(f"simulated driver: no attributes for MIG profile {mig.profile}")
        return MigFacts(mig.uuid, mig.profile, mig.memory_mb, known.multiprocessors, mig.gpu_slices,
                        mig.compute_slices, known.copy_engines, known.decoders, known.encoders, known.jpeg_engines,
                        known.ofa_engines)

    def mig_devices(self) -> dict[str, list[MigInfo]]:
        """The MIG devices the GPUs were built with."""
        return {bus_id: list(found) for bus_id, found in self._mig_devices.items()} if self.available else {}

    def set_mig_devices(self, bus_id: str, devices: Iterable[MigInfo]) -> None:
        """Repartition one GPU (in MIG mode from now on): its MIG devices are these."""
        bus_id = normalize_bus_id(bus_id)
        self._mig.add(bus_id)
        self._mig_devices[bus_id] = list(devices)

    def open_events(self, uuids: Iterable[str]) -> NvmlEventSet:
        """An event set fed by the inject_* methods."""
        if not self.available:
            raise NvmlUnavailableError(self.unavailable_reason)
        with self._lock:
            watched = frozenset(u for u in uuids if u in self._gpus and "events" not in self._gpus[u].unsupported)
            events: queue.SimpleQueue[NvmlEvent | None] = queue.SimpleQueue()
            for uuid in sorted(watched):
                if self._gpus[uuid].lost:
                    events.put(NvmlEvent("lost", uuid))
            self._listeners.append((watched, events))
        return _SimEventSet(events, lambda: self._drop(events))

    def _drop(self, events: queue.SimpleQueue[NvmlEvent | None]) -> None:
        with self._lock:
            self._listeners = [(w, q) for w, q in self._listeners if q is not events]

    def _answering(self, uuid: str) -> _SimGpu:
        """The GPU a query reads, with the lock held; raises as NVML would (unavailable, no such GPU, lost)."""
        if not self.available:
            raise NvmlUnavailableError(self.unavailable_reason)
        gpu = self._gpus.get(uuid)
        if gpu is None:
            raise NvmlError(f"{uuid}: no such GPU")
        if gpu.lost:
            raise GpuLostError(uuid, "GPU is lost")
        return gpu

    def memory_health(self, uuid: str) -> MemoryHealth:
        """The GPU's simulated counters; None for groups marked unsupported."""
        with self._gate.call(), self._lock:
            gpu = self._answering(uuid)
            hidden = {f.name: None for f in fields(MemoryHealth) for group in gpu.unsupported
                      for prefix in _FIELD_GROUPS.get(group, ()) if f.name.startswith(prefix)}
            return replace(gpu.health, **hidden)  # type: ignore[arg-type]  # only the Optional fields are named

    def gpu_state(self, uuid: str) -> GpuState:
        """NVLink, fabric and recovery action as set (and as an override file says); unsupported parts empty."""
        with self._gate.call(), self._lock:
            gpu = self._answering(uuid)
            links, fabric, action = dict(gpu.nvlinks), gpu.fabric, gpu.recovery_action
            errors, unsupported = dict(gpu.failing), set(gpu.unsupported)
        links, fabric, action, errors = self._overridden(uuid, links, fabric, action, errors)
        return GpuState(uuid, {} if "nvlink" in unsupported or "nvlink" in errors else links,
                        None if "fabric" in unsupported or "fabric" in errors else fabric,
                        None if "recovery_action" in unsupported or "recovery_action" in errors else action, errors)

    def _overridden(self, uuid: str, links: dict[int, bool], fabric: GpuFabric | None, action: int,
                    errors: dict[str, str]) -> tuple[dict[int, bool], GpuFabric | None, int, dict[str, str]]:
        path = self.overrides_dir / f"{uuid}.json" if self.overrides_dir is not None else None
        if path is None or not path.is_file():
            return links, fabric, action, errors
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            for link in data.get("nvlink_inactive", []):
                links[int(link)] = False
            if "fabric" in data:
                raw = data["fabric"]
                state = raw["state"]
                names = {v: k for k, v in FABRIC_STATES.items()}
                fabric = GpuFabric(names[state] if isinstance(state, str) else int(state), int(raw.get("status", 0)),
                                   int(raw.get("health_mask", 0)), int(raw.get("health_summary", 0)))
                fabric = fabric if fabric.state != FABRIC_NOT_SUPPORTED else None
            if "recovery_action" in data:
                value = data["recovery_action"]
                action = {v: k for k, v in RECOVERY_ACTIONS.items()}[value] if isinstance(value, str) else int(value)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            why = f"simulated override {path} unreadable: {type(exc).__name__}: {exc}"
            return links, fabric, action, {**errors, **dict.fromkeys(STATE_PARTS, why)}
        return links, fabric, action, errors

    def running_processes(self, uuid: str) -> list[int]:
        """The PIDs set with `set_processes` (a reset ends them)."""
        with self._gate.call(), self._lock:
            return sorted(self._answering(uuid).processes)

    def set_processes(self, uuid: str, pids: Iterable[int]) -> None:
        """Processes start or stop using the GPU."""
        with self._lock:
            self._gpus[uuid].processes = list(pids)

    def suspend(self, timeout_s: float) -> bool:
        """Close the session as RealNvml does for a reset: queries wait until `resume`."""
        def closed() -> None:
            self.suspensions += 1
        return self._gate.suspend(timeout_s, closed)

    def resume(self) -> None:
        """Queries run again."""
        self._gate.resume()

    @property
    def suspended(self) -> bool:
        """True while a reset has the session closed."""
        return self._gate.suspended

    def set_nvlink(self, uuid: str, link: int, active: bool) -> None:
        """One NVLink of this GPU goes inactive or active (a link the GPU did not have is added)."""
        with self._lock:
            self._gpus[uuid].nvlinks[link] = active

    def set_fabric(self, uuid: str, state: int, status: int = 0, health_mask: int = 0,
                   health_summary: int = 0) -> None:
        """The GPU's fabric probe state (api.FABRIC_*), its status (an NVML return code), mask and summary."""
        with self._lock:  # like the real port, a state of NOT_SUPPORTED reads as no fabric at all
            self._gpus[uuid].fabric = GpuFabric(state, status, health_mask, health_summary) \
                if state != FABRIC_NOT_SUPPORTED else None

    def set_recovery_action(self, uuid: str, action: int) -> None:
        """The driver's recovery action for this GPU (an NVML value, api.RECOVERY_ACTIONS; 0 = none)."""
        with self._lock:
            self._gpus[uuid].recovery_action = action

    def fail_state(self, uuid: str, part: str, why: str = "NVMLError_Unknown: simulated") -> None:
        """Make one `gpu_state` part (nvlink, fabric, recovery_action) fail; an empty `why` heals it."""
        if part not in STATE_PARTS:
            raise ValueError(f"part must be one of {', '.join(STATE_PARTS)}")
        with self._lock:
            if why:
                self._gpus[uuid].failing[part] = why
            else:
                self._gpus[uuid].failing.pop(part, None)

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
        """Make call groups unsupported on this GPU: ecc, retired_pages, remapped_rows, events, nvlink, fabric,
        recovery_action."""
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
            gpu.recovery_action = 0  # the reset the driver asked for is done
            gpu.processes = []  # a reset ends every context on the GPU
            gpu.health = replace(gpu.health, ecc_corrected_volatile=0, ecc_uncorrected_volatile=0,
                                  retired_pages_pending=False, remap_pending=False)


class _SimEventSet:
    """Events fed by the inject_* methods. `interrupt` puts a None in the queue, which wakes a blocked wait at once;
    from then on waits only collect what is queued."""

    def __init__(self, events: queue.SimpleQueue[NvmlEvent | None], on_close: Any) -> None:
        self._events, self._on_close = events, on_close
        self._interrupted = False

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        found: list[NvmlEvent] = []
        while True:
            block = not (found or self._interrupted)
            try:
                item = self._events.get(timeout=timeout_s) if block else self._events.get_nowait()
            except queue.Empty:
                return found
            if item is not None:
                found.append(item)

    def interrupt(self) -> None:
        self._interrupted = True
        self._events.put(None)

    def close(self) -> None:
        self._on_close()
