"""Which network interfaces carry the host's default route (IPv4 or IPv6), from /proc/net.

A NIC that carries the default route is the node's own uplink; handing it to a pod would cut the node off, so
the device plugin never offers it (the SR-IOV network device plugin has the same rule).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="ascii", errors="replace").splitlines()
    except OSError as exc:
        log.debug("cannot read %s: %s", path, exc)
        return []


def default_route_interfaces(proc_root: Path | str = Path("/proc")) -> frozenset[str]:
    """Interfaces named by a default route in `net/route` or `net/ipv6_route`; unreadable files count as none."""
    found: set[str] = set()
    # net/route: "Iface Destination Gateway Flags RefCnt Use Metric Mask ..." with hex fields
    for line in _read_lines(Path(proc_root) / "net" / "route")[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            found.add(fields[0])
    # net/ipv6_route: "dest dest_prefixlen src src_prefixlen nexthop metric refcnt use flags iface"
    for line in _read_lines(Path(proc_root) / "net" / "ipv6_route"):
        fields = line.split()
        if len(fields) >= 10 and fields[0] == "0" * 32 and fields[1] == "00" and fields[9] != "lo":
            found.add(fields[9])
    return frozenset(found)
