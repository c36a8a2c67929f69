"""The NVML port: the only module that imports `pynvml` (nvidia-ml-py).

`RealNvml` talks to the driver; `SimulatedNvml` answers for a simulated profile. Both share the small `Nvml`
protocol. A node without the NVIDIA driver is normal (CPU nodes, tests, laptops): NVML then reports itself
unavailable, once, and the rest of the agent carries on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Protocol

from agent.topology.model import BusIdError, normalize_bus_id

log = logging.getLogger(__name__)


class Nvml(Protocol):
    """What the agent asks of NVML."""

    @property
    def available(self) -> bool:
        """True once NVML initialised."""

    def gpu_uuids(self) -> dict[str, str]:
        """GPU UUIDs keyed by canonical bus id (`0000:3b:00.0`); empty when NVML is unavailable."""


class RealNvml:
    """NVML through nvidia-ml-py. Initialises lazily; a missing library or driver makes it unavailable."""

    def __init__(self, library: ModuleType | None = None) -> None:
        self._library = library
        self._lock = threading.Lock()
        self._initialised: bool | None = None
        self.unavailable_reason = ""

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


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class SimulatedNvml:
    """NVML for a simulated node: the UUIDs the profile gives its GPUs."""

    def __init__(self, uuids: Mapping[str, str]) -> None:
        self._uuids = {normalize_bus_id(k): v for k, v in uuids.items()}

    @property
    def available(self) -> bool:
        """A simulated NVML is always there."""
        return True

    def gpu_uuids(self) -> dict[str, str]:
        """The profile's UUIDs."""
        return dict(self._uuids)
