"""Pair ConnectX-8 Data Direct NICs with their DMA functions from sysfs, by the VPD keyword `V3`.

Nothing else links them in sysfs: the PF sits on one PCI segment, the DMA function (15b3:2100) on the GPU's, and
segments cross (NIC 0000:03:00.0 <-> DMA 0009:03:00.0 on a GB300), so bus-id order pairs them wrongly.
rdma-core's `rdma_topo` pairs them the same way: every PF whose V3 (the ASIC's id) equals the DMA function's.
A `vpd` that cannot be read or trusted leaves its NIC at its own PCIe position: one warning (once per problem,
not per rescan) and a line in `Topology.locality_problems`, which `doctor` reports.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from agent.topology.locality import MAX_VPD, VpdError, vpd_keywords
from agent.topology.model import PciInfo
from agent.topology.sysfs_file import read_sysfs_file

log = logging.getLogger(__name__)

# problems already warned about: a rescan (every few minutes) logs the same one at debug level only
_warned: set[str] = set()
_WARNED_MAX = 1024


class PciFunction(Protocol):
    """What pairing needs of a function the sysfs reader found."""

    @property
    def path(self) -> Path: ...
    @property
    def pci(self) -> PciInfo: ...


F = TypeVar("F", bound=PciFunction)


class UnreadableVpd(Exception):
    """A `vpd` file that exists but cannot be read."""


def read_binary(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of a binary attribute, None when absent; UnreadableVpd otherwise.

    Every read of `vpd` goes to the device (config-space polling, up to 125 ms a dword): read once, in big chunks,
    non-blocking and only from a regular file (a FIFO planted in the tree must not hang the scan)."""
    try:
        return read_sysfs_file(path, limit)
    except OSError as exc:
        raise UnreadableVpd(f"{path}: cannot read ({exc.strerror or exc})") from exc


def _warn_once(line: str) -> None:
    if line in _warned:
        log.debug("%s", line)
        return
    if len(_warned) < _WARNED_MAX:
        _warned.add(line)
    log.warning("%s", line)


def _v3(f: PciFunction, problems: list[str], *, dma: bool) -> bytes | None:
    """The function's VPD-R V3 keyword; None (warned, noted for doctor) when unreadable or odd. A PF without a
    `vpd` file simply is not Data Direct; a DMA function without one is a problem."""
    path = f.path / "vpd"
    try:
        data = read_binary(path, MAX_VPD)
        if data is None:
            if not dma:
                return None
            raise UnreadableVpd(f"{path}: missing")
        v3 = vpd_keywords(data).get("V3")
        if v3 is None:
            raise VpdError("no V3 keyword")
        return v3.strip(b" \x00")
    except (UnreadableVpd, VpdError) as exc:
        detail = str(exc) if isinstance(exc, UnreadableVpd) else f"{path}: {exc}"
        whose = "its NIC stays" if dma else f"{f.pci.bus_id} stays"
        line = f"Data Direct pairing: {detail}; {whose} at its own PCIe position"
        _warn_once(line)
        problems.append(line)
        return None


def pair(dmas: Iterable[F], pfs: Iterable[F], problems: list[str]) -> dict[str, F]:
    """PF bus id -> its DMA function, for the ConnectX PFs `pfs` and the DMA functions `dmas` (both ports of a
    dual-port ConnectX-8 share one). Problems are appended to `problems`, one line each."""
    by_v3: dict[bytes, list[F]] = {}
    for dma in dmas:
        v3 = _v3(dma, problems, dma=True)
        if v3:
            by_v3.setdefault(v3, []).append(dma)
    if not by_v3:
        return {}
    pairs: dict[str, F] = {}
    for pf in pfs:
        v3 = _v3(pf, problems, dma=False)
        found = by_v3.get(v3, []) if v3 else []
        if len(found) == 1:
            pairs[pf.pci.bus_id] = found[0]
        elif found:
            line = (f"{pf.pci.bus_id}: VPD V3 matches {len(found)} Data Direct DMA functions "
                    f"({', '.join(d.pci.bus_id for d in found)}); it stays at its own PCIe position")
            _warn_once(line)
            problems.append(line)
    return pairs
