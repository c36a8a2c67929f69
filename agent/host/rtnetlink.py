"""Netdev state over rtnetlink, in-process: one RTM_GETLINK dump, and a live RTNLGRP_LINK subscription.

Hand-rolled rather than through pyroute2 for two reasons. pyroute2 0.9's asyncio socket treats any receive error
as the death of the socket (its `error_received` marks it failed for good), and ENOBUFS — the kernel saying it
dropped notifications because we read too slowly — is the one error this reader must survive, count and answer
with a fresh dump. And its synchronous `IPRoute` starts a private event loop per socket, which is most of what the
old once-a-second check cost. Only three attributes of `struct ifinfomsg` messages are needed (IFLA_IFNAME,
IFLA_OPERSTATE, IFLA_CARRIER; include/uapi/linux/rtnetlink.h and if_link.h), and that layout is kernel ABI.

The subscription socket is non-blocking and read from the agent's event loop when the kernel says it is readable
(`loop.add_reader`): no thread waits on it. Sockets can be opened inside a named network namespace (tests).
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
import struct
from dataclasses import dataclass, field

from agent.host.netlink import (
    ATTR,
    ATTR_TYPE_MASK,
    HEADER,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_OVERRUN,
    NetlinkTruncated,
    messages,
    open_socket,
)

RTMGRP_LINK = 1  # the multicast group bit of RTNLGRP_LINK (group 1)
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
IFLA_IFNAME, IFLA_OPERSTATE, IFLA_CARRIER = 3, 16, 33
# IF_OPER_* (RFC 2863), as `ip link` and /sys/class/net/<if>/operstate spell them
OPERSTATES = ("unknown", "notpresent", "down", "lowerlayerdown", "testing", "dormant", "up")
RECEIVE_SIZE = 1 << 16  # larger than any one link message (VF lists are only in dumps that ask for them)
_IFINFO = struct.Struct("=BBHiII")  # ifinfomsg
_seq = itertools.count(1)


@dataclass(frozen=True)
class NetdevState:
    """Operational state of one netdev, lower case ("up", "down", "lowerlayerdown", "unknown", ...)."""

    operstate: str
    carrier: bool | None = None


@dataclass
class LinkNews:
    """What one read of the subscription brought: netdevs changed (None: removed), or `lost`: events were dropped
    (the socket overran), so only a fresh dump tells the truth."""

    changes: dict[str, NetdevState | None] = field(default_factory=dict)
    lost: bool = False


def parse_links(data: bytes, news: LinkNews, seq: int | None = None) -> bool:
    """Add the link messages of one datagram to `news`; True at the end of a dump (NLMSG_DONE). A truncated or
    malformed datagram, or NLMSG_OVERRUN, sets `lost`. Only AF_UNSPEC messages describe netdevs: the bridge also
    sends AF_BRIDGE RTM_NEWLINK/RTM_DELLINK for a port joining or leaving it, which is not the netdev changing."""
    try:
        for kind, body, end in messages(data, seq, "RTM_GETLINK"):
            if kind == NLMSG_DONE:
                return True
            if kind == NLMSG_OVERRUN:
                news.lost = True
            _add_link(data, kind, body, end, news)
    except NetlinkTruncated:
        news.lost = True
    return False


def _add_link(data: bytes, kind: int, body: int, end: int, news: LinkNews) -> None:
    if kind not in (RTM_NEWLINK, RTM_DELLINK) or end - body < _IFINFO.size or data[body] != socket.AF_UNSPEC:
        return
    name, state = _link(data, body + _IFINFO.size, end)
    if name:
        news.changes[name] = state if kind == RTM_NEWLINK else None


def _link(data: bytes, pos: int, end: int) -> tuple[str, NetdevState]:
    name, operstate, carrier = "", "unknown", None
    while pos + ATTR.size <= end:
        size, kind = ATTR.unpack_from(data, pos)
        if size < ATTR.size:
            break
        kind &= ATTR_TYPE_MASK
        if kind == IFLA_IFNAME:
            name = data[pos + 4:pos + size].split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == IFLA_OPERSTATE and size > 4:
            value = data[pos + 4]
            operstate = OPERSTATES[value] if value < len(OPERSTATES) else f"state{value}"
        elif kind == IFLA_CARRIER and size > 4:
            carrier = bool(data[pos + 4])
        pos += (size + 3) & ~3
    return name, NetdevState(operstate, carrier)


def dump_links(netns: str | None = None, timeout: float = 5.0) -> dict[str, NetdevState]:
    """Every netdev of the namespace, by name (one RTM_GETLINK dump; blocking, run it in a worker thread)."""
    with open_socket(socket.NETLINK_ROUTE, netns, timeout=timeout) as sock:
        seq = next(_seq)
        request = HEADER.pack(HEADER.size + _IFINFO.size, RTM_GETLINK, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
        sock.send(request + _IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0, 0))
        news = LinkNews()
        while not parse_links(sock.recv(RECEIVE_SIZE), news, seq):
            if news.lost:
                raise OSError(errno.EIO, "RTM_GETLINK: truncated reply")
    return {name: state for name, state in news.changes.items() if state is not None}


class LinkSubscription:
    """RTNLGRP_LINK notifications: `changed()` waits for the next ones; `close()` ends the subscription."""

    def __init__(self, netns: str | None = None, receive_buffer: int | None = 1 << 20) -> None:
        self._sock = open_socket(socket.NETLINK_ROUTE, netns, groups=RTMGRP_LINK, receive_buffer=receive_buffer)
        self._sock.setblocking(False)
        self.overruns = 0  # ENOBUFS from the kernel: notifications were dropped

    async def changed(self) -> LinkNews:
        """The netdevs changed since the last call (waits until there is at least one change or a loss)."""
        while True:
            news = self._drain()
            if news.changes or news.lost:
                return news
            await self._readable()

    def _drain(self) -> LinkNews:
        news = LinkNews()
        while True:
            try:
                data = self._sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                return news
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                self.overruns += 1  # the socket keeps working; what was dropped is unknown
                news.lost = True
                continue
            parse_links(data, news)

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self._sock.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)

    def close(self) -> None:
        """Leave the group and release the socket."""
        self._sock.close()
