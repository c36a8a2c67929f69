"""The shapers' counters over rtnetlink, in-process and without pyroute2: what a metrics scrape reads.

One RTM_GETTCLASS dump per shaped interface, asking only for the classes of our HTB (`tcm_parent` = its handle:
the kernel's class dump is per device and skips every other qdisc), and of each answer only `TCA_STATS2`'s
basic (bytes) and queue (drops) blocks are decoded. The limited class counts what its leaf does: HTB adds a
packet's bytes to the class as it dequeues it from the leaf, and counts a drop when the leaf refuses one
(`net/sched/sch_htb.c`); both are created and removed together, so they start together.

This replaced one pyroute2 qdisc dump per scrape, which decoded every attribute of every qdisc of every
interface of the node (the kernel dumps all devices' qdiscs whatever index is asked for): 43 ms median, 168 ms
for the first, at 250 pods (`bench/shaping.py`). Layouts: `struct tcmsg` (include/uapi/linux/rtnetlink.h),
`struct gnet_stats_basic` and `gnet_stats_queue` (include/uapi/linux/gen_stats.h): kernel ABI.
"""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Iterable

from agent.host.netlink import (
    HEADER,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NetlinkTruncated,
    attrs,
    messages,
    open_socket,
)
from agent.host.tc import LIMITED, ROOT, ShaperCounters, TcError

RTM_NEWTCLASS, RTM_GETTCLASS = 40, 42
TCA_STATS2 = 7
TCA_STATS_BASIC, TCA_STATS_QUEUE = 1, 3
RECEIVE_SIZE = 1 << 16  # one HTB class message is a few hundred bytes
_TCMSG = struct.Struct("=BBHiIII")  # family, pad, pad, ifindex, handle, parent, info
_U64 = struct.Struct("=Q")
_U32 = struct.Struct("=I")
_seq = itertools.count(1)


def _stats(data: bytes, pos: int, end: int) -> ShaperCounters:
    """Bytes and drops from a class message's attributes (TCA_STATS2 only)."""
    sent = drops = 0
    for kind, start, stop in attrs(data, pos, end):
        if kind != TCA_STATS2:
            continue
        for inner, at, until in attrs(data, start, stop):
            if inner == TCA_STATS_BASIC and until - at >= _U64.size:
                (sent,) = _U64.unpack_from(data, at)  # gnet_stats_basic: __u64 bytes, __u32 packets
            elif inner == TCA_STATS_QUEUE and until - at >= 12:
                (drops,) = _U32.unpack_from(data, at + 8)  # gnet_stats_queue: qlen, backlog, drops, ...
    return ShaperCounters(sent, drops)


def parse_classes(data: bytes, seq: int, handle: int, out: dict[int, ShaperCounters]) -> bool:
    """Add the counters of class `handle` found in one datagram of a class dump to `out` (by ifindex); True at
    the end of the dump. An error answer raises TcError."""
    try:
        for kind, body, end in messages(data, seq, "class dump"):
            if kind == NLMSG_DONE:
                return True
            if kind == RTM_NEWTCLASS and end - body >= _TCMSG.size:
                _family, _, _, index, class_handle, _parent, _info = _TCMSG.unpack_from(data, body)
                if class_handle == handle:
                    out[index] = _stats(data, body + _TCMSG.size, end)
    except (NetlinkTruncated, OSError) as exc:
        raise TcError(exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)) from None
    return False


class ClassCounters:
    """The limited classes' counters of chosen interfaces; one netlink socket, opened on first use."""

    def __init__(self, netns: str | None = None, timeout: float = 5.0) -> None:
        self.netns = netns
        self.timeout = timeout
        self._socket: socket.socket | None = None

    def _sock(self) -> socket.socket:
        if self._socket is None:
            self._socket = open_socket(socket.NETLINK_ROUTE, self.netns, timeout=self.timeout)
        return self._socket

    def read(self, indexes: Iterable[int]) -> dict[int, ShaperCounters]:
        """Counters of our limited class on each of `indexes` that has one (an interface that is gone, or has no
        HTB of ours, is left out). Blocking: call from a worker thread."""
        out: dict[int, ShaperCounters] = {}
        try:
            sock = self._sock()
            for index in sorted(set(indexes)):
                seq = next(_seq) & 0xFFFFFFFF
                sock.send(HEADER.pack(HEADER.size + _TCMSG.size, RTM_GETTCLASS, NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
                          + _TCMSG.pack(socket.AF_UNSPEC, 0, 0, index, 0, ROOT, 0))
                while not parse_classes(sock.recv(RECEIVE_SIZE), seq, LIMITED, out):
                    pass
        except OSError as exc:
            self.close()  # a timeout or error leaves answers in flight: the next read starts on a fresh socket
            raise TcError(f"class dump: {exc}") from exc
        except TcError:
            self.close()
            raise
        return out

    def close(self) -> None:
        """Release the socket."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
