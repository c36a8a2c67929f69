"""The scrape's class-dump decoder on hand-built datagrams (the kernel's layouts); real dumps are read in
tests/shaping/test_e2e_namespaces.py against the leaves' counters."""

from __future__ import annotations

import struct

import pytest

from agent.host.netlink import NLMSG_DONE, NLMSG_ERROR
from agent.host.tc import LIMITED, ROOT, ShaperCounters, TcError
from agent.host.tc_stats import (
    RTM_NEWTCLASS,
    TCA_STATS2,
    TCA_STATS_BASIC,
    TCA_STATS_QUEUE,
    parse_classes,
)

TCA_KIND, TCA_STATS_APP = 1, 4


def nla(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def message(kind: int, seq: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 2, seq, 0) + body + b"\0" * (-len(body) % 4)


def tclass(seq: int, index: int, handle: int, sent: int, drops: int) -> bytes:
    stats = nla(TCA_STATS2, nla(TCA_STATS_BASIC, struct.pack("=QI4x", sent, 7))
                + nla(TCA_STATS_QUEUE, struct.pack("=IIIII", 0, 0, drops, 0, 3))
                + nla(TCA_STATS_APP, b"\1" * 20))
    return message(RTM_NEWTCLASS, seq, struct.pack("=BBHiIII", 0, 0, 0, index, handle, ROOT, 0)
                   + nla(TCA_KIND, b"htb\0") + stats)


def test_the_limited_class_bytes_and_drops_by_interface():
    out: dict[int, ShaperCounters] = {}
    data = tclass(9, 41, LIMITED, 5_000_000_000, 12) + tclass(9, 41, ROOT | 2, 1, 1) + message(NLMSG_DONE, 9, b"\0" * 4)
    assert parse_classes(data, 9, LIMITED, out)
    assert out == {41: ShaperCounters(5_000_000_000, 12)}


def test_answers_to_another_request_are_skipped_and_the_dump_may_span_datagrams():
    out: dict[int, ShaperCounters] = {}
    assert not parse_classes(tclass(8, 41, LIMITED, 1, 1) + tclass(9, 42, LIMITED, 2, 0), 9, LIMITED, out)
    assert parse_classes(message(NLMSG_DONE, 9, b"\0" * 4), 9, LIMITED, out)
    assert out == {42: ShaperCounters(2, 0)}


def test_an_error_answer_or_a_truncated_datagram_raises():
    with pytest.raises(TcError, match="No such device"):
        parse_classes(message(NLMSG_ERROR, 3, struct.pack("=i", -19) + b"\0" * 16), 3, LIMITED, {})
    with pytest.raises(TcError, match="truncated"):
        parse_classes(tclass(3, 41, LIMITED, 1, 1)[:-8], 3, LIMITED, {})
