"""NIC link health: is each RDMA physical function's link up? While it is not, its VFs are Unhealthy.

The state is read through `agent.host.links.LinkPort` (netlink and sysfs on a host, sysfs files in a
simulation); this module judges it: a PF is down when a netdev has no carrier or is not up, or an RDMA port is
not ACTIVE.
"""

from __future__ import annotations

import asyncio
import logging

from agent import aio
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.host.links import LinkPort, NetdevState
from agent.topology.model import Nic

log = logging.getLogger(__name__)

_UP_OPERSTATES = {"up"}
_MAYBE_UP_OPERSTATES = {"unknown"}  # drivers that do not report operstate: trust the carrier


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

    def __init__(self, port: LinkPort, assessor: HealthAssessor, interval: float, *,
                 checks: Checks | None = None) -> None:
        self.port = port
        self.assessor = assessor
        self.checks = checks if checks is not None else Checks()
        self.interval = interval
        self.first_pass = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Check until `stop`; errors from the port go to the supervisor."""
        if self.interval <= 0:
            self.checks.set("links", CheckState.OFF)
            self.first_pass.set()
            return
        while not stop.is_set():
            await self.check_once()
            self.checks.set("links", CheckState.OK)
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
