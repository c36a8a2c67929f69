"""Read ipset members and their counters over netlink, in-process, without forking `ipset`.

Why hand-rolled: per scrape we read every element of eight counted sets. Measured on the 2-core VM at 1,000 pods
(8,000 elements): this parser 7.5 ms, `ipset -` batch save plus a regex parse 12.5 ms, pyroute2's `IPSet.list()`
110 ms (it decodes every attribute lazily into objects). The protocol is small and stable (ipset protocol 6/7,
include/uapi/linux/netfilter/ipset/ip_set.h), and only the dump of one named set is needed.

Members are keyed by their packed address (plus the prefix length for hash:net), so no text formatting happens on
the hot path. Sockets can be opened inside a named network namespace (`/run/netns/NAME`) for tests: network
namespaces are per thread, so the calling thread switches in, opens the socket and switches back.
"""

from __future__ import annotations

import errno
import itertools
import socket
import struct
from dataclasses import dataclass, field

from agent.host import netlink
from agent.host.netlink import (
    ATTR,
    ATTR_TYPE_MASK,
    HEADER,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NetlinkTruncated,
    attr,
    messages,
)

NETLINK_NETFILTER = 12
NFNL_SUBSYS_IPSET = 6
IPSET_CMD_LIST = 7
IPSET_PROTOCOL = 7
ATTR_PROTOCOL, ATTR_SETNAME, ATTR_TYPENAME, ATTR_FAMILY, ATTR_DATA, ATTR_ADT = 1, 2, 3, 5, 7, 8
ELEM_IP, ELEM_CIDR, ELEM_CADT_FLAGS, ELEM_BYTES, ELEM_PACKETS = 1, 3, 8, 24, 25
FLAG_WITH_COUNTERS = 1 << 3
_U64 = struct.Struct(">Q")


class NetlinkError(OSError):
    """The kernel refused an ipset request (the errno says why)."""


@dataclass
class SetDump:
    """One set as the kernel reports it: type, family (2 or 10), create flags, members with (packets, bytes)."""

    name: str
    type_name: str = ""
    family: int = 0
    flags: int = 0
    members: dict[tuple[bytes, int], tuple[int, int]] = field(default_factory=dict)


def _parse_element(data: bytes, pos: int, end: int) -> tuple[tuple[bytes, int], tuple[int, int]]:
    address, cidr, packets, octets = b"", -1, 0, 0
    while pos < end:
        size, kind = ATTR.unpack_from(data, pos)
        kind &= ATTR_TYPE_MASK
        if kind == ELEM_IP:
            inner, _ = ATTR.unpack_from(data, pos + 4)
            address = data[pos + 8:pos + 4 + inner]
        elif kind == ELEM_BYTES:
            octets = _U64.unpack_from(data, pos + 4)[0]
        elif kind == ELEM_PACKETS:
            packets = _U64.unpack_from(data, pos + 4)[0]
        elif kind == ELEM_CIDR:
            cidr = data[pos + 4]
        pos += (size + 3) & ~3
    if cidr < 0:
        cidr = len(address) * 8
    return (address, cidr), (packets, octets)


def _parse_message(data: bytes, pos: int, end: int, dump: SetDump) -> None:
    while pos < end:
        size, kind = ATTR.unpack_from(data, pos)
        kind &= ATTR_TYPE_MASK
        if kind == ATTR_ADT:
            inner, inner_end = pos + 4, pos + size
            while inner < inner_end:
                item_size, _ = ATTR.unpack_from(data, inner)
                key, value = _parse_element(data, inner + 4, inner + item_size)
                dump.members[key] = value
                inner += (item_size + 3) & ~3
        elif kind == ATTR_TYPENAME:
            dump.type_name = data[pos + 4:pos + size].rstrip(b"\0").decode()
        elif kind == ATTR_FAMILY:
            dump.family = data[pos + 4]
        elif kind == ATTR_DATA:
            inner, inner_end = pos + 4, pos + size
            while inner < inner_end:
                item_size, item_kind = ATTR.unpack_from(data, inner)
                if item_kind & ATTR_TYPE_MASK == ELEM_CADT_FLAGS:
                    dump.flags = struct.unpack_from(">I", data, inner + 4)[0]
                inner += (item_size + 3) & ~3
        pos += (size + 3) & ~3


class NetfilterSocket:
    """One NETLINK_NETFILTER socket for a reader, opened on first use (in `netns`), with its own request sequence,
    and the dump loop of its readers; a failed dump closes it, since a half-read dump leaves it out of step. Errors
    are raised as `error` (the reader's own OSError subclass). Not thread-safe (callers hold their own lock)."""

    error: type[OSError] = OSError

    def __init__(self, netns: str | None = None, timeout: float = 5.0) -> None:
        self._netns = netns
        self._timeout = timeout
        self._sock: socket.socket | None = None
        self._seq = itertools.count(1)

    def close(self) -> None:
        """Close the socket (a later call opens a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            self._sock = netlink.open_socket(NETLINK_NETFILTER, self._netns, receive_buffer=1 << 20,
                                             timeout=self._timeout)
        return self._sock

    def _dump(self, subsystem: int, command: int, family: int, request: bytes,
              what: str) -> list[tuple[bytes, int, int]] | None:
        """Every answer message of one nfnetlink dump as (datagram, attributes start after nfgenmsg, end); None
        when the kernel answers ENOENT (no such set or table: that answer is the whole dump, the socket stays in
        step)."""
        seq = next(self._seq)
        body = struct.pack("=BBH", family, 0, 0) + request
        out: list[tuple[bytes, int, int]] = []
        try:
            sock = self._socket()
            sock.send(HEADER.pack(HEADER.size + len(body), (subsystem << 8) | command, NLM_F_REQUEST | NLM_F_DUMP,
                                  seq, 0) + body)
            while True:
                data = sock.recv(1 << 20)
                try:
                    for kind, start, end in messages(data, seq, what):
                        if kind == NLMSG_DONE:
                            return out
                        out.append((data, start + 4, end))
                except OSError as exc:  # the kernel's error answer (messages raises it)
                    if exc.errno == errno.ENOENT:
                        return None
                    raise self.error(exc.errno, exc.strerror) from None
        except OSError:
            self.close()  # a half-read dump leaves the socket out of step; start clean next time
            raise
        except (NetlinkTruncated, struct.error) as exc:
            self.close()
            raise self.error(errno.EPROTO, f"{what}: malformed reply: {exc}") from exc


class IpsetReader(NetfilterSocket):
    """Dumps named sets over one netlink socket."""

    error = NetlinkError

    def dump(self, name: str) -> SetDump | None:
        """Members and counters of set `name`, or None when no such set exists."""
        what = f"ipset list {name}"
        request = attr(ATTR_PROTOCOL, bytes([IPSET_PROTOCOL])) + attr(ATTR_SETNAME, name.encode() + b"\0")
        answer = self._dump(NFNL_SUBSYS_IPSET, IPSET_CMD_LIST, socket.AF_INET, request, what)
        if answer is None:
            return None
        dump = SetDump(name)
        try:
            for data, start, end in answer:
                _parse_message(data, start, end, dump)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise NetlinkError(errno.EPROTO, f"{what}: malformed reply: {exc}") from exc
        return dump
