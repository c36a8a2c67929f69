"""Kernel-log faults beyond NVRM: mlx5_core firmware/driver faults, PCIe AER errors and NVSwitch SXids.

Each parsed line names the PCI function it is about (canonical bus id), so the NIC/PCIe producer can map it to
the devices under that bus id; a line for a function that is not on this node changes nothing. Formats
(node-health-checks.md §4; Linux drivers/net/ethernet/mellanox/mlx5/core/{health,cmd,events}.c,
drivers/pci/pcie/aer.c; NVIDIA Fabric Manager user guide for SXid):

- `mlx5_core <bdf>: <function>:<line>:(pid <n>): <text>`: fatal when the firmware heartbeat stopped ("health
  compromised - reached miss count"), a health syndrome says "unrecoverable hardware error", a fatal sensor
  tripped ("Fatal error <n> detected") or a firmware command timed out ("timeout. Will cause a leak of a command
  resource"); a warning for "Detected insufficient power on the PCIe slot" and a module "High Temperature".
  ACCESS_REG failures are noise caused by counter reads on firmware-managed PFs and are not matched.
- AER, both the root port's line (`AER: Uncorrected (Fatal) error received: <bdf>`, since 2023
  `AER: Uncorrectable (Fatal) error message received from <bdf>`) and the device's own (`<bdf>: [AER: ]PCIe Bus
  Error: severity=Uncorrected (Non-Fatal), ...`). Corrected errors are counted by `aer_dev_correctable`.
- `nvidia-nvswitch<n>: SXid (PCI:<bdf>): <code>, Fatal, ...`: fatal NVSwitch errors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.host.busid import BusIdError, normalize_bus_id

_BDF = r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
_MLX5 = re.compile(rf"^mlx5_core (?P<bdf>{_BDF}): (?P<text>.*)$")
_MLX5_FATAL = re.compile(r"health compromised - reached miss count|unrecoverable hardware error|"
                         r"Fatal error \d+ detected|timeout\. Will cause a leak of a command resource")
_MLX5_WARNING = re.compile(r"Detected insufficient power on the PCIe slot|Port module event\[error\].*High Temperature")
_AER_SOURCE = re.compile(rf"AER: (?:Multiple )?(?P<severity>Uncorrect(?:ed|able) \((?:Non-)?Fatal\)) error "
                         rf"(?:received|message received from):? (?P<bdf>{_BDF})")
_AER_DEVICE = re.compile(rf"^\S+ (?P<bdf>{_BDF}): (?:AER: )?(?:PCIe|CXL) Bus Error: "
                         r"severity=(?P<severity>Uncorrect(?:ed|able) \((?:Non-)?Fatal\))")
_SXID = re.compile(rf"^nvidia-nvswitch\d+: SXid \(PCI:(?P<bdf>{_BDF})\): (?P<code>\d+), Fatal")
_HINTS = ("mlx5_core", "AER", "Bus Error", "SXid")


@dataclass(frozen=True)
class PciFault:
    """One kernel-log fault: `kind` is the check it feeds (nic_driver_fatal, pcie_aer_fatal, ...)."""

    kind: str
    bus_id: str
    text: str


def parse_pci_fault(message: str) -> PciFault | None:
    """The fault one kernel-log record describes, or None (most records, and malformed ones)."""
    if not any(hint in message for hint in _HINTS):
        return None
    line = message.strip()
    fault = _mlx5(line) or _aer(line) or _sxid(line)
    if fault is None:
        return None
    try:
        return PciFault(fault[0], normalize_bus_id(fault[1]), line[:200])
    except BusIdError:
        return None


def _mlx5(line: str) -> tuple[str, str] | None:
    match = _MLX5.match(line)
    if match is None:
        return None
    if _MLX5_FATAL.search(match["text"]):
        return "nic_driver_fatal", match["bdf"]
    if _MLX5_WARNING.search(match["text"]):
        return "nic_driver_warning", match["bdf"]
    return None


def _aer(line: str) -> tuple[str, str] | None:
    match = _AER_SOURCE.search(line) or _AER_DEVICE.match(line)
    if match is None:
        return None
    return ("pcie_aer_nonfatal" if "Non-Fatal" in match["severity"] else "pcie_aer_fatal"), match["bdf"]


def _sxid(line: str) -> tuple[str, str] | None:
    match = _SXID.match(line)
    return ("nvswitch_fatal", match["bdf"]) if match else None
