"""The set-element decoder of the nfnetlink reader on hand-built answers (layout: include/uapi/linux/netfilter/
nf_tables.h): counters decoded exactly, a cut answer is a clear error, never an IndexError or a wrong count."""

from __future__ import annotations

import struct

import pytest

from agent.host import nft_netlink as nl
from agent.host.netlink import NetlinkTruncated


def attr(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + b"\0" * (-size % 4)


def element(address: bytes, packets: int, octets: int) -> bytes:
    """One NFTA_LIST_ELEM as the kernel dumps an element of a set declared with `counter`."""
    counter = attr(nl.COUNTER_BYTES, struct.pack(">Q", octets)) + attr(nl.COUNTER_PACKETS, struct.pack(">Q", packets))
    expr = attr(nl.EXPR_NAME, b"counter\0") + attr(nl.EXPR_DATA | 0x8000, counter)
    body = attr(nl.ELEM_KEY | 0x8000, attr(nl.DATA_VALUE, address)) + attr(nl.ELEM_EXPR | 0x8000, expr)
    return attr(nl.LIST_ELEM | 0x8000, body)


def test_counters_of_every_element_are_decoded() -> None:
    payload = element(bytes([10, 244, 1, 2]), 3, 2 ** 40 + 7) + element(bytes(15) + b"\1", 1, 48)
    counted: dict[bytes, tuple[int, int]] = {}
    nl._elements(payload, 0, len(payload), counted, None)
    assert counted == {bytes([10, 244, 1, 2]): (3, 2 ** 40 + 7), bytes(15) + b"\1": (1, 48)}


@pytest.mark.parametrize("cut", [5, 13, 30, 41])
def test_a_cut_answer_is_a_clear_error(cut: int) -> None:
    payload = element(bytes([10, 244, 1, 2]), 3, 300)
    cut_payload = bytearray(payload[:cut])
    with pytest.raises(NetlinkTruncated):
        nl._elements(bytes(payload), 0, len(cut_payload), {}, None)
    # through the reader's public methods the same becomes an OSError, which a scrape reports as netacct_up 0
    assert issubclass(nl.NftNetlinkError, OSError)
