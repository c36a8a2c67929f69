"""Node facts GPU Feature Discovery reads from sysfs: the machine type and the NVIDIA functions' vGPU capability.

Read under a sysfs root (`/sys`, or a simulated tree), in the kernel's formats: `class/dmi/id/product_name`, and
per PCI function `bus/pci/devices/<bdf>/{vendor,config}`. The vGPU scan follows GFD's (NVIDIA/k8s-device-plugin
internal/vgpu): every NVIDIA function's configuration space must be readable in full (256 bytes or more: only
root reads past the first 64), its capability list is walked for the vendor-specific capability (id 0x09), and
a vGPU carries the signature "VF" in bytes 3-4 and, after byte 5, records ending at the host driver record
(id 0: 10 bytes of version, 10 of branch). Any unreadable function fails the scan, as it fails GFD's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

NVIDIA_VENDOR = "0x10de"
_STATUS, _CAP_LIST, _CAP_PTR, _VENDOR_CAP = 0x06, 0x10, 0x34, 0x09
_RECORD_START, _VERSION_LEN, _BRANCH_LEN = 5, 10, 10


class PciScanError(Exception):
    """A function's files could not be read: the scan has no answer."""


@dataclass(frozen=True)
class VgpuCapability:
    """What the scan found: whether any NVIDIA function is a vGPU, and the host driver's version and branch."""

    present: bool
    host_driver_version: str = ""
    host_driver_branch: str = ""


def read_machine_type(sysfs_root: str | os.PathLike[str]) -> str | None:
    """`class/dmi/id/product_name`, trimmed; None when it cannot be read."""
    try:
        with (Path(sysfs_root) / "class/dmi/id/product_name").open("rb") as handle:
            return handle.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return None


def vendor_capability(config: bytes) -> bytes | None:
    """The vendor-specific capability of a configuration space, None when there is none; PciScanError when the
    space is not read in full."""
    if len(config) < 256:
        raise PciScanError("the PCI configuration space is not readable in full (needs root)")
    if not config[_STATUS] & _CAP_LIST:
        return None
    seen: set[int] = set()
    pos = config[_CAP_PTR]
    while pos and pos not in seen and config[pos] != 0xFF:
        if config[pos] == _VENDOR_CAP:
            return config[pos:pos + config[pos + 2]]
        seen.add(pos)
        pos = config[pos + 1]
    return None


def host_driver(capability: bytes) -> tuple[str, str] | None:
    """The host driver record of a vGPU capability: (version, branch), None when there is none."""
    pos = _RECORD_START
    record = capability[pos] if len(capability) > pos else 0
    while record != 0 and pos < len(capability):
        pos += capability[pos + 1] if pos + 1 < len(capability) else len(capability)
        record = capability[pos] if pos < len(capability) else 0
    end = pos + 2 + _VERSION_LEN + _BRANCH_LEN
    if record != 0 or end > len(capability):
        return None
    data = capability[pos + 2:end]
    return (data[:_VERSION_LEN].decode("ascii", "replace").strip("\x00"),
            data[_VERSION_LEN:].decode("ascii", "replace").strip("\x00"))


def scan_vgpu(sysfs_root: str | os.PathLike[str]) -> VgpuCapability:
    """Every NVIDIA function under `bus/pci/devices`; PciScanError when one cannot be read."""
    base = Path(sysfs_root) / "bus/pci/devices"
    try:
        names = sorted(os.listdir(base))
    except OSError as exc:
        raise PciScanError(f"cannot list {base}: {exc}") from exc
    present, version, branch = False, "", ""
    for name in names:
        try:
            if (base / name / "vendor").read_text().strip() != NVIDIA_VENDOR:
                continue
            with (base / name / "config").open("rb") as handle:
                config = handle.read(4096)  # the extended configuration space is 4096 bytes; nothing more
        except OSError as exc:
            raise PciScanError(f"{name}: {exc}") from exc
        capability = vendor_capability(config)
        if capability is None or len(capability) < 5 or capability[3:5] != b"VF":
            continue
        present = True
        found = host_driver(capability)
        if found is None:
            raise PciScanError(f"{name}: no host driver record in the vGPU capability")
        version, branch = found
    return VgpuCapability(present, version, branch)
