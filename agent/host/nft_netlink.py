"""Read netacct's nftables table over nfnetlink, in-process: named counters, set elements and their counters.

Why hand-rolled, as for ipset (ipset_netlink): the scrape reads every element of eight counted sets plus the
named counters, and forking `nft -j list table` or rendering JSON through libnftables costs far more than the
decode (see bench/netacct_scrape.py and the README's Performance table). The nf_tables dump protocol is stable
(include/uapi/linux/netfilter/nf_tables.h); only five dumps of one table are needed, each filtered by table
(and set) in the request, and only the attributes used here are decoded.

A missing table or set is an answer, not an error: `sets` and `elements` say None (the kernel answers ENOENT), the
counter and chain dumps come back empty. The engine uses it to decide what to create.
"""

from __future__ import annotations

import errno
import functools
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from agent.host.ipset_netlink import NetfilterSocket
from agent.host.netlink import (
    ATTR,
    ATTR_TYPE_MASK,
    NetlinkTruncated,
    attr,
    attrs,
)

NFNL_SUBSYS_NFTABLES = 10
NFPROTO_INET = 1
MSG_GETCHAIN, MSG_GETRULE, MSG_GETSET, MSG_GETSETELEM, MSG_GETOBJ = 4, 7, 10, 13, 19
CHAIN_TABLE, CHAIN_NAME, CHAIN_HOOK, CHAIN_TYPE = 1, 3, 4, 7
HOOK_NUM, HOOK_PRIORITY = 1, 2
RULE_TABLE, RULE_CHAIN, RULE_USERDATA = 1, 2, 7
SET_TABLE, SET_NAME, SET_FLAGS, SET_KEY_TYPE, SET_EXPR, SET_EXPRESSIONS = 1, 2, 3, 4, 17, 18
ELEM_LIST_TABLE, ELEM_LIST_SET, ELEM_LIST_ELEMENTS = 1, 2, 3
ELEM_KEY, ELEM_FLAGS, ELEM_EXPR, ELEM_EXPRESSIONS = 1, 3, 7, 11
OBJ_TABLE, OBJ_NAME, OBJ_TYPE, OBJ_DATA = 1, 2, 3, 4
OBJECT_COUNTER = 1
LIST_ELEM, DATA_VALUE, EXPR_NAME, EXPR_DATA = 1, 1, 1, 2
COUNTER_BYTES, COUNTER_PACKETS = 1, 2
SET_INTERVAL = 0x4
ELEM_INTERVAL_END = 0x1
UDATA_RULE_COMMENT = 0
_BE32 = struct.Struct(">I")
_BE32S = struct.Struct(">i")
_BE64 = struct.Struct(">Q")

Counts = tuple[int, int]  # packets, bytes
Range = tuple[int, int]  # first address, one past the last (an integer of the family's width)


class NftNetlinkError(OSError):
    """The kernel refused a dump, or its answer could not be decoded."""


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _decoding(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """A malformed answer becomes NftNetlinkError (an OSError, which the engine reports), never an IndexError."""
    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(*args, **kwargs)
        except (NetlinkTruncated, struct.error, IndexError, UnicodeDecodeError) as exc:
            raise NftNetlinkError(errno.EPROTO, f"nftables: malformed answer: {exc}") from exc
    return wrapper


@dataclass
class SetInfo:
    """A set's definition as the kernel reports it."""

    name: str
    flags: int = 0
    key_type: int = 0
    counter: bool = False  # every element carries a counter expression


@dataclass
class ChainInfo:
    """A chain: its hook number and priority when it is a base chain, its type, its rules' comments in order."""

    name: str
    hook: int | None = None
    priority: int | None = None
    kind: str = ""
    comments: list[str] = field(default_factory=list)


@dataclass
class Elements:
    """One set's elements: plain keys with their counters, and the ranges of an interval set."""

    counted: dict[bytes, Counts] = field(default_factory=dict)
    ranges: list[Range] = field(default_factory=list)


def _string(data: bytes, start: int, end: int) -> str:
    return data[start:end].split(b"\0", 1)[0].decode()


def _counts(data: bytes, start: int, end: int) -> Counts:
    """(packets, bytes) of a counter's attributes (NFTA_COUNTER_BYTES / NFTA_COUNTER_PACKETS)."""
    packets = octets = 0
    for kind, s, _ in attrs(data, start, end):
        if kind == COUNTER_BYTES:
            octets = _BE64.unpack_from(data, s)[0]
        elif kind == COUNTER_PACKETS:
            packets = _BE64.unpack_from(data, s)[0]
    return packets, octets


def _counter(data: bytes, start: int, end: int) -> Counts | None:
    """(packets, bytes) of a `counter` expression (NFTA_EXPR_NAME / NFTA_EXPR_DATA), else None."""
    name, value = "", None
    for kind, s, e in attrs(data, start, end):
        if kind == EXPR_NAME:
            name = _string(data, s, e)
        elif kind == EXPR_DATA:
            value = _counts(data, s, e)
    return value if name == "counter" else None


def _comment(userdata: bytes) -> str:
    """The comment TLV of a rule's userdata (libnftnl udata: type u8, length u8, value)."""
    pos = 0
    while pos + 2 <= len(userdata):
        kind, size = userdata[pos], userdata[pos + 1]
        if kind == UDATA_RULE_COMMENT:
            return userdata[pos + 2:pos + 2 + size].split(b"\0", 1)[0].decode()
        pos += 2 + size
    return ""


def _cstr(text: str) -> bytes:
    return text.encode() + b"\0"


class NftReader(NetfilterSocket):
    """Dumps one nftables table (family inet) over one netlink socket."""

    def __init__(self, table: str, netns: str | None = None, timeout: float = 5.0) -> None:
        super().__init__(netns, timeout)
        self.table = table

    error = NftNetlinkError

    def _nft_dump(self, command: int, request: bytes, what: str) -> list[tuple[bytes, int, int]] | None:
        """Every answer message of one dump of this family; None when the kernel says ENOENT (no such table or
        set)."""
        return self._dump(NFNL_SUBSYS_NFTABLES, command, NFPROTO_INET, request, what)

    def _of_table(self, dump: list[tuple[bytes, int, int]] | None,
                  table_attr: int) -> Iterator[tuple[bytes, list[tuple[int, int, int]]]]:
        """The attributes of each answer message that names this table in `table_attr` (the kernel's chain dump
        does not filter by table; the others do, and this costs them nothing)."""
        for data, start, end in dump or ():
            found = list(attrs(data, start, end))
            if any(kind == table_attr and _string(data, s, e) == self.table for kind, s, e in found):
                yield data, found

    @_decoding
    def counters(self) -> dict[str, Counts]:
        """The table's named counters (empty when the table does not exist: the kernel filters, it does not
        refuse)."""
        request = attr(OBJ_TABLE, _cstr(self.table)) + attr(OBJ_TYPE, _BE32.pack(OBJECT_COUNTER))
        dump = self._nft_dump(MSG_GETOBJ, request, f"nft list counters table inet {self.table}")
        out: dict[str, Counts] = {}
        for data, found in self._of_table(dump, OBJ_TABLE):
            name, value = "", (0, 0)
            for kind, s, e in found:
                if kind == OBJ_NAME:
                    name = _string(data, s, e)
                elif kind == OBJ_DATA:
                    value = _counts(data, s, e)
            out[name] = value
        return out

    @_decoding
    def sets(self) -> dict[str, SetInfo] | None:
        """The table's set definitions, or None when the table does not exist."""
        dump = self._nft_dump(MSG_GETSET, attr(SET_TABLE, _cstr(self.table)), f"nft list sets table inet {self.table}")
        if dump is None:
            return None
        out: dict[str, SetInfo] = {}
        for data, found in self._of_table(dump, SET_TABLE):
            info = SetInfo("")
            for kind, s, e in found:
                if kind == SET_NAME:
                    info.name = _string(data, s, e)
                elif kind == SET_FLAGS:
                    info.flags = _BE32.unpack_from(data, s)[0]
                elif kind == SET_KEY_TYPE:
                    info.key_type = _BE32.unpack_from(data, s)[0]
                elif kind == SET_EXPR:
                    info.counter = _string(data, s + 4, e) == "counter" if e - s > 4 else False
                elif kind == SET_EXPRESSIONS:
                    for _, a, b in attrs(data, s, e):
                        info.counter |= any(k == EXPR_NAME and _string(data, x, y) == "counter"
                                            for k, x, y in attrs(data, a, b))
            out[info.name] = info
        return out

    @_decoding
    def chains(self) -> dict[str, ChainInfo]:
        """The table's chains with their hooks and their rules' comments (empty when the table does not exist)."""
        dump = self._nft_dump(MSG_GETCHAIN, attr(CHAIN_TABLE, _cstr(self.table)), f"nft list chains inet {self.table}")
        out: dict[str, ChainInfo] = {}
        for data, found in self._of_table(dump, CHAIN_TABLE):
            info = ChainInfo("")
            for kind, s, e in found:
                if kind == CHAIN_NAME:
                    info.name = _string(data, s, e)
                elif kind == CHAIN_TYPE:
                    info.kind = _string(data, s, e)
                elif kind == CHAIN_HOOK:
                    for inner, a, _ in attrs(data, s, e):
                        if inner == HOOK_NUM:
                            info.hook = _BE32.unpack_from(data, a)[0]
                        elif inner == HOOK_PRIORITY:
                            info.priority = _BE32S.unpack_from(data, a)[0]
            out[info.name] = info
        rules = self._nft_dump(MSG_GETRULE, attr(RULE_TABLE, _cstr(self.table)), f"nft list table inet {self.table}")
        for data, found in self._of_table(rules, RULE_TABLE):
            chain, comment = "", ""
            for kind, s, e in found:
                if kind == RULE_CHAIN:
                    chain = _string(data, s, e)
                elif kind == RULE_USERDATA:
                    comment = _comment(data[s:e])
            if chain in out:
                out[chain].comments.append(comment)
        return out

    @_decoding
    def elements(self, set_name: str, ranges: bool = False) -> Elements | None:
        """One set's elements with their counters (and, when `ranges`, the ranges of an interval set); None when
        the set does not exist."""
        request = attr(ELEM_LIST_TABLE, _cstr(self.table)) + attr(ELEM_LIST_SET, _cstr(set_name))
        dump = self._nft_dump(MSG_GETSETELEM, request, f"nft list set inet {self.table} {set_name}")
        if dump is None:
            return None
        out = Elements()
        bounds: list[tuple[int, int, int]] | None = [] if ranges else None  # (address, 0 end / 1 start, bits)
        for data, start, end in dump:
            for kind, s, e in attrs(data, start, end):
                if kind == ELEM_LIST_ELEMENTS:
                    _elements(data, s, e, out.counted, bounds)
        if bounds is not None:
            out.ranges = _ranges(bounds)
        return out


def _elements(data: bytes, pos: int, end: int, counted: dict[bytes, Counts],
              bounds: list[tuple[int, int, int]] | None) -> None:
    """Decode a NFTA_SET_ELEM_LIST_ELEMENTS payload. The hot loop of a scrape (8,000 elements at 1,000 pods), so
    it walks the attributes inline instead of through `attrs`, and checks every length against `end`."""
    unpack, be32, be64 = ATTR.unpack_from, _BE32.unpack_from, _BE64.unpack_from
    while pos + 4 <= end:
        size, _ = unpack(data, pos)
        elem_end = pos + size
        if size < 4 or elem_end > end:
            raise NetlinkTruncated("nftables: truncated set element")
        key, flags, packets, octets = b"", 0, 0, 0
        inner = pos + 4
        while inner + 4 <= elem_end:
            isize, ikind = unpack(data, inner)
            iend = inner + isize
            if isize < 4 or iend > elem_end:
                raise NetlinkTruncated("nftables: truncated set element attribute")
            ikind &= ATTR_TYPE_MASK
            if ikind == ELEM_KEY and isize >= 8:
                vsize, _ = unpack(data, inner + 4)
                key = data[inner + 8:inner + 4 + vsize]
            elif ikind == ELEM_FLAGS:
                flags = be32(data, inner + 4)[0]
            elif ikind == ELEM_EXPR and data[inner + 8:inner + 16] == b"counter\0":
                # NFTA_EXPR_NAME "counter" (12 bytes with its header), then NFTA_EXPR_DATA {BYTES, PACKETS}
                data_at = inner + 4 + 12
                cend = data_at + unpack(data, data_at)[0]
                if cend > iend:
                    raise NetlinkTruncated("nftables: truncated counter")
                c = data_at + 4
                while c + 12 <= cend:
                    csize, ckind = unpack(data, c)
                    if ckind & ATTR_TYPE_MASK == COUNTER_BYTES:
                        octets = be64(data, c + 4)[0]
                    elif ckind & ATTR_TYPE_MASK == COUNTER_PACKETS:
                        packets = be64(data, c + 4)[0]
                    c += (csize + 3) & ~3
            elif ikind == ELEM_EXPRESSIONS:
                for _, a, b in attrs(data, inner + 4, iend):
                    packets, octets = _counter(data, a, b) or (packets, octets)
            inner += (isize + 3) & ~3
        counted[key] = (packets, octets)
        if bounds is not None:
            bounds.append((int.from_bytes(key, "big"), 0 if flags & ELEM_INTERVAL_END else 1, len(key) * 8))
        pos += (size + 3) & ~3


def _ranges(bounds: list[tuple[int, int, int]]) -> list[Range]:
    """Ranges from interval-set elements: a start element opens one, the next end element (its key one past the
    last address) closes it; an open range runs to the top of the address space. Adjacent ranges are merged."""
    out: list[Range] = []
    opened: int | None = None
    width = 0
    for address, is_start, bits in sorted(bounds):
        width = bits
        if is_start:
            if opened is None:
                opened = address
        elif opened is not None:
            out.append((opened, address))
            opened = None
    if opened is not None:
        out.append((opened, 1 << width))
    return merge(out)


def merge(ranges: list[Range]) -> list[Range]:
    """Sorted ranges with overlapping or adjacent ones joined."""
    out: list[Range] = []
    for first, after in sorted(ranges):
        if out and first <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], after))
        else:
            out.append((first, after))
    return out
