"""NIC link health: is each RDMA physical function's link up? While it is not, its VFs are Unhealthy.

The state is read through `agent.host.links.LinkPort` (netlink and sysfs on a host, sysfs files in a
simulation); this module judges it: a PF is down when a netdev has no carrier or is not up, or an RDMA port is
not ACTIVE. It is judged when the kernel reports a change of one of the PFs' netdevs (RTM_NEWLINK/RTM_DELLINK),
not on a clock: the poll (`link_check_interval_seconds`, 30 s by default) is only the safety net.
"""

from __future__ import annotations

import asyncio
import logging

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.host.links import LinkEvents, LinkNews, LinkPort, NetdevState
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
    """Judges every RDMA PF at start, at once when one of their netdevs changes (the port's event stream), after
    a lost stream (read again with a dump, counted in `resyncs`), when `nudge`d, and every `interval` seconds as
    a safety net for what no event reports (an RDMA port state changing alone, a stream that went quiet)."""

    def __init__(self, port: LinkPort, assessor: HealthAssessor, interval: float, *, clock: Clock = SYSTEM_CLOCK,
                 checks: Checks | None = None, events: bool = True) -> None:
        self.port = port
        self.assessor = assessor
        self.clock = clock
        self.checks = checks if checks is not None else Checks()
        self.interval = interval
        self.events = events
        self.first_pass = asyncio.Event()
        self.resyncs = 0  # event streams that lost news and were read again with a dump
        self.passes = 0  # judgements of every PF (start, events, polls, resyncs)
        self._netdevs: dict[str, NetdevState] = {}
        self._wake = asyncio.Event()
        self._nudged = False
        self._events_failed = False

    def nudge(self) -> None:
        """Read everything again now (another check saw an RDMA port change state)."""
        self._nudged = True
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Check until `stop`; errors from the port go to the supervisor."""
        if self.interval <= 0:
            self.checks.set("links", CheckState.OFF)
            self.first_pass.set()
            return
        stream = await self._subscribe() if self.events else None
        stopping = asyncio.ensure_future(stop.wait())
        stopping.add_done_callback(lambda _: self._wake.set())
        pending: asyncio.Future[LinkNews] | None = None
        try:
            await self.check_once()
            self.checks.set("links", CheckState.OK)
            self.first_pass.set()
            deadline = self.clock.monotonic() + self.interval
            while not stop.is_set():
                if stream is not None and pending is None:
                    pending = asyncio.ensure_future(stream.changed())
                    pending.add_done_callback(lambda _: self._wake.set())
                await self.clock.wait(self._wake, deadline - self.clock.monotonic())
                self._wake.clear()
                if stop.is_set():
                    break
                full = self._nudged or self.clock.monotonic() >= deadline
                self._nudged = False
                if pending is not None and pending.done():
                    news, pending = pending.result(), None
                    full = self._apply(news) or full
                    if not full and news.changes.keys() & self._watched():
                        await self._judge()
                if full:
                    if stream is None and self.events:
                        stream = await self._subscribe()  # events failed before: try again, quietly
                    await self.check_once()
                    deadline = self.clock.monotonic() + self.interval
        finally:
            await aio.cancel_and_wait(pending, stopping)
            if stream is not None:
                stream.close()

    async def _subscribe(self) -> LinkEvents | None:
        try:
            stream = await asyncio.to_thread(self.port.subscribe)
        except OSError as exc:
            if not self._events_failed:
                log.error("no netlink link events (%s); checking NIC links every %g s until they work", exc,
                          self.interval)
            self._events_failed = True
            return None
        if self._events_failed:
            log.info("netlink link events work again")
        self._events_failed = False
        return stream

    def _apply(self, news: LinkNews) -> bool:
        """Take the news in; True when it cannot be trusted (events were lost) and everything must be read."""
        if news.lost:
            self.resyncs += 1
            log.warning("netlink link events were dropped (socket overrun); reading every link again")
            return True
        for name, state in news.changes.items():
            if state is None:
                self._netdevs.pop(name, None)
            else:
                self._netdevs[name] = state
        return False

    def _watched(self) -> set[str]:
        return {name for nic in self.assessor.topology.rdma_nics for name in nic.netdevs}

    async def check_once(self) -> None:
        """Read every netdev (a dump) and judge every RDMA NIC."""
        self._netdevs = await asyncio.to_thread(self.port.netdev_states)
        await self._judge()

    async def _judge(self) -> None:
        """Judge every RDMA NIC on the netdev states known now and its RDMA ports read now."""
        nics = self.assessor.topology.rdma_nics
        if not nics:
            return
        ports = await asyncio.to_thread(self._ports, nics)
        self.passes += 1
        for nic in nics:
            problem = link_problem(nic, self._netdevs, ports.get(nic.rdma or "", {}))
            self.assessor.on_link(nic, problem is None, problem or "")

    def _ports(self, nics: tuple[Nic, ...]) -> dict[str, dict[int, str]]:
        return {n.rdma: self.port.rdma_port_states(n.rdma) for n in nics if n.rdma}
