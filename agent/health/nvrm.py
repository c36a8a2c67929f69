"""Parse the NVIDIA driver's (NVRM) kernel-log lines that matter for health: Xids, bus loss, UUID map lines.

Every form from the reference is accepted: `NVRM: Xid (PCI:0000:05:00): 79, ...`, the older form without
`PCI:`, 8-digit domains, MIG lines with a `GPU-I:05` suffix, the "has fallen off the bus" line that comes
without an Xid, and `NVRM: GPU at PCI:0000:2b:00: GPU-<uuid>` which names a GPU's UUID. Kernel-log text is
untrusted, so the parser never raises: anything it does not recognise is None.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.host.busid import device_key

_DEVICE = r"(?:PCI:)?([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \(" + _DEVICE + r"(?:\s+GPU-I:\s*(\d{1,6}))?[^)]*\):\s*(\d{1,6})\b,?\s*(.*)",
                  re.DOTALL)
_XID_ANY_DEVICE = re.compile(r"NVRM: Xid \(([^)]{0,64})\):\s*(\d{1,6})\b,?\s*(.*)", re.DOTALL)
_FALLEN = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at )?" + _DEVICE + r"\b.{0,200}?fallen off the bus",
                     re.DOTALL)
_GPU_MAP = re.compile(r"NVRM: GPU at " + _DEVICE + r":\s*(GPU-[0-9a-fA-F-]{8,64})")
_NVRM = re.compile(r"NVRM:")
_XID_START = re.compile(r"NVRM: Xid ")
_FALLEN_START = re.compile(r"NVRM: (?:The NVIDIA )?GPU (?:at )?" + _DEVICE)
_CAUSED_BY = re.compile(r"caused by previous Xid (\d{1,6})")


@dataclass(frozen=True)
class XidLine:
    """An Xid reported in the kernel log. `device` is `dddd:bb:dd`, or the raw text when it is not a bus id."""

    device: str
    code: int
    detail: str = ""
    gpu_instance: int | None = None  # MIG GPU instance (GPU-I) when the line names one
    caused_by: int | None = None  # Xid 45 cascades name the Xid that caused them
    device_parsed: bool = True


@dataclass(frozen=True)
class FallenOffBus:
    """`NVRM: The NVIDIA GPU 0000:b3:00.0 ... has fallen off the bus` (no Xid line needed)."""

    device: str


@dataclass(frozen=True)
class GpuUuidLine:
    """`NVRM: GPU at PCI:0000:2b:00: GPU-...`: which UUID sits at a bus address."""

    device: str
    uuid: str


NvrmLine = XidLine | FallenOffBus | GpuUuidLine


def parse_nvrm(message: str) -> NvrmLine | None:
    """The first health-relevant NVRM event in one kernel-log message, or None. Never raises."""
    found = parse_nvrm_all(message)
    return found[0] if found else None


def parse_nvrm_all(message: str) -> list[NvrmLine]:
    """Every health-relevant NVRM event in one kernel-log message, in order. Never raises.

    A message normally holds one, but a dmesg dump pasted into a file, or a record of several lines, may hold
    a burst: each `NVRM: Xid` in it counts, so the text is cut at each `NVRM:` and every piece is parsed."""
    if "NVRM" not in message:
        return []
    starts = [m.start() for m in _NVRM.finditer(message)] or [0]
    found: list[NvrmLine] = []
    pieces = [message[a:b] for a, b in zip(starts, [*starts[1:], len(message)], strict=True)]
    for piece in _join_fallen(pieces):
        try:
            line = _parse(piece)
        except (ValueError, IndexError):  # defensive: the patterns should make these impossible
            line = None
        if line is not None:
            found.append(line)
    return found


def _join_fallen(pieces: list[str]) -> list[str]:
    """The bus-loss message spans several `NVRM:` lines of one record ("The NVIDIA GPU ... / NVRM: (PCI ID: ...)
    installed in this system has / NVRM: fallen off the bus ..."): keep such a run together."""
    out: list[str] = []
    for piece in pieces:
        if out and _FALLEN_START.search(out[-1]) and not _XID_START.match(piece) \
                and not _FALLEN_START.match(piece) and "fallen off the bus" not in out[-1]:
            out[-1] += piece
        else:
            out.append(piece)
    return out


def _parse(message: str) -> NvrmLine | None:
    if (match := _XID.search(message)) is not None:
        domain, bus, dev, instance, code, detail = match.groups()
        caused = _CAUSED_BY.search(detail)
        return XidLine(device_key(domain, bus, dev), int(code), detail.strip()[:300],
                       int(instance) if instance else None, int(caused.group(1)) if caused else None)
    if (match := _XID_ANY_DEVICE.search(message)) is not None:
        raw, code, detail = match.groups()
        return XidLine(raw.strip(), int(code), detail.strip()[:300], device_parsed=False)
    if (match := _FALLEN.search(message)) is not None:
        return FallenOffBus(device_key(*match.groups()))
    if (match := _GPU_MAP.search(message)) is not None:
        domain, bus, dev, uuid = match.groups()
        return GpuUuidLine(device_key(domain, bus, dev), uuid)
    return None
