"""The pool as the API sees it: each device's JSON with its attributes and, when unhealthy, a device taint.

An Unhealthy device keeps its place in the slice (so a pod already using it keeps a device the scheduler
knows) and gets `gpunodeagent.io/unhealthy=<reason>`: `NoSchedule` stops new allocations; `NoExecute`, for
faults that call for a drain, also evicts the pods using it (`/work/shared/reference/dra.md` section 5.3).
The taint goes when the device recovers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.dra.devices import DOMAIN, DraDevice

TAINT_KEY = f"{DOMAIN}/unhealthy"
_LABEL_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class DeviceFault:
    """Why a device is Unhealthy; `drain` when the fault calls for evicting its users."""

    reason: str
    drain: bool = False

    @property
    def effect(self) -> str:
        """The taint effect."""
        return "NoExecute" if self.drain else "NoSchedule"


def taint_value(reason: str) -> str:
    """A label value (<= 63 characters, alphanumeric at both ends) from a free-text reason."""
    value = _LABEL_BAD.sub("-", reason)[:63].strip("-_.")
    return value or "Unhealthy"


def device_entries(devices: Sequence[DraDevice], faults: Mapping[str, DeviceFault]) -> list[dict[str, Any]]:
    """`spec.devices` entries in pool order; `faults` is keyed by `DraDevice.health_id`."""
    entries = []
    for device in devices:
        entry: dict[str, Any] = {"name": device.name, "attributes": dict(device.attributes)}
        fault = faults.get(device.health_id)
        if fault is not None:
            entry["taints"] = [{"key": TAINT_KEY, "value": taint_value(fault.reason), "effect": fault.effect}]
        entries.append(entry)
    return entries
