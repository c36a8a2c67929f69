"""The netlink ipset parser on hand-built kernel replies (multi-part dumps, IPv6, hash:net, errors)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct

import pytest

from agent.host import ipset_netlink as nl
from agent.host.netlink import NLMSG_DONE, NLMSG_ERROR


def attr(kind: int, payload: bytes, flags: int = 0) -> bytes:
    """One netlink attribute, padded."""
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind | flags) + payload + b"\0" * (-size % 4)


def element(ip: str, packets: int, octets: int, cidr: int | None = None) -> bytes:
    """One IPSET_ATTR_DATA element as the kernel nests it."""
    address = ipaddress.ip_address(ip)
    inner = attr(1 if address.version == 4 else 2, address.packed, 0x4000)
    body = attr(nl.ELEM_IP, inner, 0x8000)
    if cidr is not None:
        body += attr(nl.ELEM_CIDR, bytes([cidr]))
    body += attr(nl.ELEM_BYTES, struct.pack(">Q", octets), 0x4000)
    body += attr(nl.ELEM_PACKETS, struct.pack(">Q", packets), 0x4000)
    return attr(nl.ATTR_DATA, body, 0x8000)


def message(seq: int, elements: list[bytes], family: int = socket.AF_INET, kind: int = (6 << 8) | 7) -> bytes:
    """One list reply message."""
    body = struct.pack("=BBH", family, 0, 0) + attr(nl.ATTR_SETNAME, b"s\0") + attr(nl.ATTR_TYPENAME, b"hash:ip\0")
    body += attr(nl.ATTR_FAMILY, bytes([family]))
    body += attr(nl.ATTR_DATA, attr(nl.ELEM_CADT_FLAGS, struct.pack(">I", nl.FLAG_WITH_COUNTERS), 0x4000), 0x8000)
    body += attr(nl.ATTR_ADT, b"".join(elements), 0x8000)
    return struct.pack("=IHHII", 16 + len(body), kind, 2, seq, 0) + body


def control(seq: int, kind: int, code: int = 0) -> bytes:
    """NLMSG_DONE or NLMSG_ERROR."""
    body = struct.pack("=i", -code) + b"\0" * 16
    return struct.pack("=IHHII", 16 + len(body), kind, 0, seq, 0) + body


class FakeSocket:
    """Replays canned datagrams."""

    def __init__(self, datagrams: list[bytes]) -> None:
        self.datagrams = datagrams
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> int:
        """Record the request."""
        self.sent.append(data)
        return len(data)

    def recv(self, size: int) -> bytes:
        """Next canned datagram."""
        return self.datagrams.pop(0)

    def close(self) -> None:
        """Nothing to close."""


def reader_with(datagrams: list[bytes]) -> tuple[nl.IpsetReader, FakeSocket]:
    """An IpsetReader whose socket replays `datagrams`."""
    reader = nl.IpsetReader()
    sock = FakeSocket(datagrams)
    reader._sock = sock  # type: ignore[assignment]
    return reader, sock


def test_multi_part_dump() -> None:
    first = message(1, [element("10.1.2.3", 2, 2056)]) + message(1, [element("10.1.2.4", 0, 0)])
    reader, sock = reader_with([first, message(1, [element("10.1.2.5", 1, 99)]) + control(1, NLMSG_DONE)])
    dump = reader.dump("gna-rx-inet4")
    assert dump is not None and dump.type_name == "hash:ip" and dump.family == socket.AF_INET
    assert dump.flags & nl.FLAG_WITH_COUNTERS
    assert dump.members == {(ipaddress.ip_address("10.1.2.3").packed, 32): (2, 2056),
                            (ipaddress.ip_address("10.1.2.4").packed, 32): (0, 0),
                            (ipaddress.ip_address("10.1.2.5").packed, 32): (1, 99)}
    assert b"gna-rx-inet4\0" in sock.sent[0]


def test_ipv6_and_prefixes() -> None:
    reply = message(1, [element("fd00::3", 3, 3144), element("fc00::", 0, 0, cidr=7)], socket.AF_INET6)
    reader, _ = reader_with([reply + control(1, NLMSG_DONE)])
    dump = reader.dump("x")
    assert dump is not None
    assert dump.members[(ipaddress.ip_address("fd00::3").packed, 128)] == (3, 3144)
    assert (ipaddress.ip_address("fc00::").packed, 7) in dump.members


def test_missing_set_is_none_and_other_errors_raise() -> None:
    reader, _ = reader_with([control(1, NLMSG_ERROR, errno.ENOENT)])
    assert reader.dump("nope") is None
    reader, _ = reader_with([control(1, NLMSG_ERROR, errno.EPERM)])
    with pytest.raises(nl.NetlinkError):
        reader.dump("x")
    assert reader._sock is None  # a failed dump drops the socket


def test_stale_replies_of_another_request_are_skipped() -> None:
    stale = message(7, [element("10.0.0.9", 1, 1)]) + control(7, NLMSG_DONE)
    reader, _ = reader_with([stale, message(1, [element("10.0.0.1", 1, 1)]) + control(1, NLMSG_DONE)])
    dump = reader.dump("x")
    assert dump is not None and list(dump.members) == [(ipaddress.ip_address("10.0.0.1").packed, 32)]


def test_a_missing_set_keeps_the_socket_and_a_cut_reply_drops_it() -> None:
    reader, sock = reader_with([control(1, NLMSG_ERROR, errno.ENOENT)])
    assert reader.dump("nope") is None
    assert reader._sock is sock  # the error answer is the whole dump: nothing is left in flight
    reader, _ = reader_with([message(1, [element("10.0.0.1", 1, 1)])[:-6]])
    with pytest.raises(nl.NetlinkError):
        reader.dump("x")
    assert reader._sock is None
