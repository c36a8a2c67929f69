"""NIC link state from the machine: netdev operstate and carrier, and RDMA port state.

Two facts make a link: the netdev's operstate and carrier (netlink, through pyroute2: one RTM_GETLINK dump per
check) and, for RDMA devices, each port's `infiniband/<dev>/ports/<n>/state` in sysfs (only ACTIVE carries
traffic; INIT means the subnet manager has not configured it yet). `LinkPort` is the port; `NetlinkLinkPort` is
the real one and `SysfsLinkPort` its twin that reads netdev state from a (simulated) sysfs tree, so tests and
`run --simulate` flip links by writing files. Judging the state is health's job (`agent.health.links`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class NetdevState:
    """Operational state of one netdev, lower case ("up", "down", "lowerlayerdown", "unknown", ...)."""

    operstate: str
    carrier: bool | None = None


class LinkPort(Protocol):
    """Where link state comes from."""

    def netdev_states(self) -> dict[str, NetdevState]:
        """State of every netdev in the agent's network namespace, by name."""

    def rdma_port_states(self, rdma: str) -> dict[int, str]:
        """Port number -> state name (ACTIVE, DOWN, INIT, ...) of one RDMA device; {} when unknown."""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


class _SysfsRdmaPorts:
    def __init__(self, sysfs_root: str | Path) -> None:
        self.sysfs_root = Path(sysfs_root)

    def rdma_port_states(self, rdma: str) -> dict[int, str]:
        """`4: ACTIVE` -> ACTIVE, for each port of the device."""
        ports = self.sysfs_root / "class" / "infiniband" / rdma / "ports"
        try:
            names = [p.name for p in ports.iterdir() if p.name.isdigit()]
        except OSError:
            return {}
        states: dict[int, str] = {}
        for name in names:
            text = _read(ports / name / "state")
            if text is not None:
                states[int(name)] = text.split(":", 1)[-1].strip().upper()
        return states


class NetlinkLinkPort(_SysfsRdmaPorts):
    """Netdev state over netlink (pyroute2), RDMA port state from sysfs."""

    def netdev_states(self) -> dict[str, NetdevState]:
        """One RTM_GETLINK dump."""
        from pyroute2 import IPRoute  # type: ignore[import-untyped]

        states: dict[str, NetdevState] = {}
        with IPRoute() as ipr:
            for link in ipr.get_links():
                name = link.get("IFLA_IFNAME")
                if name:
                    carrier = link.get("IFLA_CARRIER")
                    states[name] = NetdevState(str(link.get("IFLA_OPERSTATE") or "unknown").lower(),
                                               None if carrier is None else bool(carrier))
        return states


class SysfsLinkPort(_SysfsRdmaPorts):
    """Netdev and port state from a sysfs tree (`class/net/<if>/operstate`, `carrier`): the simulated twin."""

    def netdev_states(self) -> dict[str, NetdevState]:
        """Every netdev under class/net."""
        base = self.sysfs_root / "class" / "net"
        states: dict[str, NetdevState] = {}
        try:
            names = [p.name for p in base.iterdir()]
        except OSError:
            return states
        for name in names:
            operstate = _read(base / name / "operstate")
            carrier = _read(base / name / "carrier")
            if operstate is not None:
                states[name] = NetdevState(operstate.lower(), None if carrier in (None, "") else carrier == "1")
        return states
