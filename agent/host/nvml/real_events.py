"""NVML event sets through nvidia-ml-py, kept across a suspended session (a GPU reset).

An event set belongs to the NVML session it was created in. When the session is closed for a GPU reset
(`agent.host.nvml.gate`), the owner frees every open set with no call in flight (NVML is thread-safe; the gate
guarantees no wait is running) and marks it released; the set's next `wait`, once the session is open again,
creates a new set and registers the same GPUs, so the health watch never notices. Events that happen while the
session is closed are not delivered: the kernel log still reports the Xids.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Protocol

from agent.host.nvml.api import (
    _DBE,
    _GPU_IS_LOST,
    _NO_INSTANCE,
    _RESET_REQUIRED,
    _SBE,
    _TIMEOUT,
    _XID,
    GpuLostError,
    NvmlError,
    NvmlEvent,
    _code,
    _text,
)

log = logging.getLogger(__name__)

WAIT_SLICE_S = 0.5  # the longest single nvmlEventSetWait: how long an interrupt or a GPU reset waits for a wait


class SessionOwner(Protocol):
    """What an event set needs of the `RealNvml` that made it."""

    def session_call(self) -> AbstractContextManager[None]:
        """Hold the shared session for one call."""

    def session_library(self) -> ModuleType:
        """The initialised library; NvmlUnavailableError otherwise."""

    def device_handle(self, nvml: ModuleType, uuid: str) -> Any:
        """The GPU's handle; GpuLostError, NvmlError."""

    def forget_events(self, events: RealEventSet) -> None:
        """The set was closed: the owner no longer frees it at a suspension."""


class RealEventSet:
    """Xid and ECC events of some GPUs on one NVML event set; `wait` and `close` belong to one thread."""

    def __init__(self, owner: SessionOwner, uuids: list[str]) -> None:
        self._owner = owner
        self._uuids = uuids
        self._nvml: ModuleType | None = None
        self._set: Any = None
        self._handles: dict[str, Any] = {}
        self._pending: list[NvmlEvent] = []
        self._lost: set[str] = set()
        self._closed = False
        self._interrupted = threading.Event()

    def open(self) -> None:
        """Create the set and register the GPUs (with the session held); NvmlError when no set can be made."""
        nvml = self._owner.session_library()
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            raise NvmlError(f"cannot create an NVML event set: {exc}") from exc
        self._nvml, self._set, self._handles = nvml, event_set, {}
        for uuid in self._uuids:
            try:
                handle = self._owner.device_handle(nvml, uuid)
                mask = (_XID | _SBE | _DBE) & nvml.nvmlDeviceGetSupportedEventTypes(handle)
                if mask:
                    nvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
                self._handles[uuid] = handle
            except GpuLostError:
                self._pending.append(NvmlEvent("lost", uuid))
            except nvml.NVMLError as exc:
                if _code(exc) in (_GPU_IS_LOST, _RESET_REQUIRED):
                    self._pending.append(NvmlEvent("lost", uuid))
                else:
                    log.warning("NVML events not available for %s (%s); polling still covers it", uuid, exc)

    def release(self) -> None:
        """Free the C event set (the session is about to close, no call in flight); the next wait opens anew."""
        self._free()

    def wait(self, timeout_s: float) -> list[NvmlEvent]:
        """Events that arrived, or [] after the timeout or once interrupted; a released set is opened again first.

        The C wait cannot be woken, so it runs in slices of at most `WAIT_SLICE_S`, each with the session held
        only for that slice: `interrupt` takes effect within one slice, and a GPU reset's suspension waits for
        one slice, not for the whole timeout. An event ends the slice it arrives in, so slicing delays none."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            with self._owner.session_call():
                if self._closed or self._interrupted.is_set():
                    return []
                if self._set is None:
                    self.open()
                if self._pending:
                    found, self._pending = self._pending, []
                    return found
                found = self._wait(min(max(left, 0.0), WAIT_SLICE_S))
            if found or left <= WAIT_SLICE_S:
                return found

    def interrupt(self) -> None:
        """The running wait returns after its current slice, later ones at once (any thread)."""
        self._interrupted.set()

    def _wait(self, timeout_s: float) -> list[NvmlEvent]:
        nvml = self._nvml
        assert nvml is not None
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
        assert nvml is not None
        for uuid, handle in self._handles.items():
            try:
                nvml.nvmlDeviceGetTemperature(handle, 0)
            except nvml.NVMLError as probe:
                if _code(probe) in (_GPU_IS_LOST, _RESET_REQUIRED) and uuid not in self._lost:
                    self._lost.add(uuid)
                    found.append(NvmlEvent("lost", uuid))
        if not found:
            raise NvmlError(f"NVML event wait: {exc}") from exc
        return found

    def _free(self) -> None:
        nvml, event_set = self._nvml, self._set
        self._set, self._handles = None, {}
        if nvml is None or event_set is None:
            return
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError as exc:
            log.debug("NVML event set free failed: %s", exc)

    def close(self) -> None:
        """Free the event set for good."""
        with self._owner.session_call():
            self._closed = True
            self._free()
        self._owner.forget_events(self)

