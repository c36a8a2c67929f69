"""NIC link state from the machine: netdev operstate and carrier, and RDMA port state; and news when it changes.

Two facts make a link: the netdev's operstate and carrier (rtnetlink: a dump, and RTNLGRP_LINK notifications as
they happen; `agent.host.rtnetlink`) and, for RDMA devices, each port's `infiniband/<dev>/ports/<n>/state` in
sysfs (only ACTIVE carries traffic; INIT means the subnet manager has not configured it yet; sysfs has no
notifications, so a reader looks again when the netdev changes). `LinkPort` is the port; `NetlinkLinkPort` is the
real one and `SysfsLinkPort` its twin that reads netdev state from a (simulated) sysfs tree and gives its news by
looking at the files every `poll_interval` seconds, so tests and `run --simulate` flip links by writing files.
Judging the state is health's job (`agent.health.links`).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Protocol

from agent.host.rtnetlink import LinkNews, LinkSubscription, NetdevState, dump_links

__all__ = ["LinkEvents", "LinkNews", "LinkPort", "NetdevState", "NetlinkLinkPort", "SysfsLinkPort"]


class LinkEvents(Protocol):
    """A live stream of netdev changes."""

    overruns: int  # times the stream lost news (the reader must read everything again)

    async def changed(self) -> LinkNews:
        """Wait for the next changes (or a loss) and return them."""
        ...

    def close(self) -> None:
        """End the stream."""


class LinkPort(Protocol):
    """Where link state comes from. The blocking calls belong in a worker thread."""

    def netdev_states(self) -> dict[str, NetdevState]:
        """State of every netdev in the agent's network namespace, by name."""
        ...

    def rdma_port_states(self, rdma: str) -> dict[int, str]:
        """Port number -> state name (ACTIVE, DOWN, INIT, ...) of one RDMA device; {} when unknown."""
        ...

    def subscribe(self) -> LinkEvents:
        """Start a stream of netdev changes (open it before the first `netdev_states`, so nothing falls between)."""
        ...


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def _read_small(path: str) -> str | None:
    """A sysfs attribute's text (at most 256 bytes), None when it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 256).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)


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
    """Netdev state over rtnetlink, RDMA port state from sysfs; `netns` (an `ip netns` name) for tests."""

    def __init__(self, sysfs_root: str | Path, netns: str | None = None,
                 receive_buffer: int | None = 1 << 20) -> None:
        super().__init__(sysfs_root)
        self.netns = netns
        self.receive_buffer = receive_buffer

    def netdev_states(self) -> dict[str, NetdevState]:
        """One RTM_GETLINK dump."""
        return dump_links(self.netns)

    def subscribe(self) -> LinkSubscription:
        """An RTNLGRP_LINK subscription (`receive_buffer` bytes of socket buffer before the kernel drops news)."""
        return LinkSubscription(self.netns, self.receive_buffer)


class SysfsLinkPort(_SysfsRdmaPorts):
    """Netdev and port state from a sysfs tree (`class/net/<if>/operstate`, `carrier`): the simulated twin."""

    def __init__(self, sysfs_root: str | Path, poll_interval: float = 1.0) -> None:
        super().__init__(sysfs_root)
        self.poll_interval = poll_interval

    def netdev_states(self) -> dict[str, NetdevState]:
        """Every netdev under class/net. Plain `os` calls on string paths: this runs every `poll_interval` over
        every netdev of a simulated node (72 on dgx-h100), and pathlib's path objects were most of the agent's
        idle CPU there (bench/footprint.py)."""
        base = os.path.join(self.sysfs_root, "class", "net")
        states: dict[str, NetdevState] = {}
        try:
            names = os.listdir(base)
        except OSError:
            return states
        for name in names:
            operstate = _read_small(f"{base}/{name}/operstate")
            carrier = _read_small(f"{base}/{name}/carrier")
            if operstate is not None:
                states[name] = NetdevState(operstate.lower(), None if carrier in (None, "") else carrier == "1")
        return states

    def subscribe(self) -> _FilePollEvents:
        """News from comparing the files every `poll_interval` seconds (a simulation has no kernel to tell it)."""
        return _FilePollEvents(self, self.netdev_states())


class _FilePollEvents:
    def __init__(self, port: SysfsLinkPort, last: dict[str, NetdevState]) -> None:
        self.port = port
        self.last = last
        self.overruns = 0

    async def changed(self) -> LinkNews:
        while True:
            await asyncio.sleep(self.port.poll_interval)
            now = await asyncio.to_thread(self.port.netdev_states)
            changes: dict[str, NetdevState | None] = {n: s for n, s in now.items() if self.last.get(n) != s}
            changes.update({n: None for n in self.last.keys() - now.keys()})
            self.last = now
            if changes:
                return LinkNews(changes)

    def close(self) -> None:
        pass
