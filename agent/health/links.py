"""NIC link health: is each RDMA physical function's link up? While it is not, its VFs are Unhealthy.

Two facts make a link: the netdev's operstate and carrier (netlink, through pyroute2: one RTM_GETLINK dump per
check) and, for RDMA devices, each port's `infiniband/<dev>/ports/<n>/state` in sysfs (only ACTIVE carries
traffic; INIT means the subnet manager has not configured it yet). The host side sits behind `LinkPort`;
`NetlinkLinkPort` is the real one and `SysfsLinkPort` its twin that reads netdev state from a (simulated)
sysfs tree, so tests and `run --simulate` flip links by writing files.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent import aio
from agent.health.assess import HealthAssessor
from agent.topology.model import Nic

log = logging.getLogger(__name__)

_UP_OPERSTATES = {"up"}
_MAYBE_UP_OPERSTATES = {"unknown"}  # drivers that do not report operstate: trust the carrier


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
        from pyroute2 import IPRoute

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


def link_problem(nic: Nic, netdevs: dict[str, NetdevState], ports: dict[int, str]) -> str | None:
    """Why this PF's link is down, or None when it is up (or nothing is known about it)."""
    problems: list[str] = []
    for name in nic.netdevs:
        state = netdevs.get(name)
        if state is None:
            continue
        if state.carrier is False:
            problems.append(f"{name} no carrier")
        elif state.operstate not in _UP_OPERSTATES and not (
                state.operstate in _MAYBE_UP_OPERSTATES and state.carrier):
            problems.append(f"{name} {state.operstate}")
    problems.extend(f"{nic.rdma} port {number} {state}" for number, state in sorted(ports.items())
                    if state != "ACTIVE")
    return ", ".join(problems) if problems else None


class LinkWatcher:
    """Checks every RDMA PF of the topology each `interval` seconds."""

    def __init__(self, port: LinkPort, assessor: HealthAssessor, interval: float) -> None:
        self.port = port
        self.assessor = assessor
        self.interval = interval
        self.first_pass = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Check until `stop`; errors from the port go to the supervisor."""
        if self.interval <= 0:
            self.assessor.checks["links"] = "off"
            self.first_pass.set()
            return
        while not stop.is_set():
            await self.check_once()
            self.assessor.checks["links"] = "ok"
            self.first_pass.set()
            await aio.sleep_or_stop(stop, self.interval)

    async def check_once(self) -> None:
        """One check of every RDMA NIC."""
        nics = self.assessor.topology.rdma_nics
        if not nics:
            return
        netdevs, ports = await asyncio.to_thread(self._read, nics)
        for nic in nics:
            problem = link_problem(nic, netdevs, ports.get(nic.rdma or "", {}))
            self.assessor.on_link(nic, problem is None, problem or "")

    def _read(self, nics: tuple[Nic, ...]) -> tuple[dict[str, NetdevState], dict[str, dict[int, str]]]:
        return self.port.netdev_states(), {n.rdma: self.port.rdma_port_states(n.rdma) for n in nics if n.rdma}
