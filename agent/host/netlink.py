"""Netlink sockets and message framing shared by the agent's raw netlink readers (rtnetlink links, tc class
counters, ipset and nftables dumps).

One datagram holds whole messages, each an `nlmsghdr` and its body, aligned to 4 bytes. `messages` walks them:
it yields (type, body start, end) for the messages of one request (`seq`), raises `NetlinkTruncated` for a cut
message and `OSError` for an error answer; a zero error (an ACK) is skipped. `attrs` walks a body's attributes
and `attr` builds one. `open_socket` opens one, in a
named network namespace when asked (namespaces are per thread: the calling thread switches in and back).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator

from agent.host.netns import entered

NLM_F_REQUEST, NLM_F_DUMP, NLM_F_MULTI = 0x1, 0x300, 0x2
NLMSG_NOOP, NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 1, 2, 3, 4
HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
ATTR = struct.Struct("=HH")  # nlattr: length, type
ATTR_TYPE_MASK = 0x3FFF


class NetlinkTruncated(ValueError):
    """A message runs past the end of its datagram (or claims less than a header)."""


def messages(data: bytes, seq: int | None, what: str) -> Iterator[tuple[int, int, int]]:
    """(type, body start, end) of each message of `data` (only those of `seq` when given). An error answer raises
    OSError(code, "<what>: <strerror>")."""
    pos = 0
    while pos + HEADER.size <= len(data):
        length, kind, _flags, msg_seq, _pid = HEADER.unpack_from(data, pos)
        if length < HEADER.size or pos + length > len(data):
            raise NetlinkTruncated(f"{what}: truncated message")
        end, body = pos + length, pos + HEADER.size
        pos = (end + 3) & ~3
        if seq is not None and msg_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", data, body)[0]
            if code:
                raise OSError(code, f"{what}: {os.strerror(code)}")
            continue
        yield kind, body, end


def attrs(data: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type without the nested / byte-order flags, payload start, payload end) of each attribute in
    data[pos:end]; one that runs past `end` (or claims less than its header) raises NetlinkTruncated."""
    while pos + ATTR.size <= end:
        size, kind = ATTR.unpack_from(data, pos)
        if size < ATTR.size or pos + size > end:
            raise NetlinkTruncated("truncated attribute")
        yield kind & ATTR_TYPE_MASK, pos + ATTR.size, pos + size
        pos += (size + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute, padded to 4 bytes."""
    size = ATTR.size + len(payload)
    return ATTR.pack(size, kind) + payload + b"\0" * (-size % 4)


def open_socket(protocol: int, netns: str | None = None, *, groups: int = 0, receive_buffer: int | None = None,
                timeout: float | None = None) -> socket.socket:
    """A bound netlink socket of `protocol` (NETLINK_ROUTE, NETLINK_NETFILTER, ...) in this thread's namespace or
    the named one, listening to multicast `groups`; closed again if setting it up fails."""
    with entered(netns):
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, protocol)
    try:
        if receive_buffer is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        if timeout is not None:
            sock.settimeout(timeout)
        sock.bind((0, groups))
    except OSError:
        sock.close()
        raise
    return sock
