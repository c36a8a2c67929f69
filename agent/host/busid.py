"""PCI bus ids in the forms the machine writes them, and the one canonical form the agent uses.

sysfs writes `0000:3b:00.0`, NVML `00000000:3B:00.0`, the NVIDIA driver's kernel-log lines `0000:3b:00` (no
function). Everything inside the agent uses the canonical lowercase sysfs form `dddd:bb:dd.f`; the kernel-log
key is only for matching NVRM lines to GPUs.
"""

from __future__ import annotations

import re

_BDF = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


class BusIdError(ValueError):
    """A string that is not a PCI bus id in any form we know."""


def normalize_bus_id(text: str) -> str:
    """Canonical sysfs form of a PCI bus id: NVML's `00000000:3B:00.0` becomes `0000:3b:00.0`."""
    match = _BDF.match(text.strip())
    if match is None:
        raise BusIdError(f"not a PCI bus id: {text!r}")
    domain, bus, dev, fn = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def is_bus_id(text: str) -> bool:
    """True when `text` parses as a PCI bus id."""
    return _BDF.match(text.strip()) is not None


def device_key(domain: str, bus: str, dev: str) -> str:
    """Kernel-log device `dddd:bb:dd` (lower case, last 4 domain digits, no function)."""
    return f"{domain[-4:].lower()}:{bus.lower()}:{dev.lower()}"


def bus_key(bus_id: str) -> str:
    """The kernel-log key of a canonical bus id: `0000:1b:00.0` -> `0000:1b:00`."""
    return bus_id.rsplit(".", 1)[0].lower()
