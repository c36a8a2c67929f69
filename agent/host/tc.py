"""The traffic-control port: per-pod internet shapers on host-side pod interfaces, over netlink (pyroute2).

Never a `tc` subprocess: every object is one netlink request, and nothing from a pod (name, annotation) ever
reaches this module except as an integer rate or an interface index; IFB names are made by the caller from a
hash and checked here against `IFB_NAME`.

What one shaped pod gets (mechanism and why: `agent.shaping`):

- download (towards the pod) on its host-side interface: HTB root `7a17:` with `default 1`; class `7a17:1`
  (rate = ceil = limit, explicit burst and quantum) holding a byte-limited bfifo `7a18:`; one u32 filter per
  internal CIDR on the *source* address with classid `7a17:0` (HTB "direct": unshaped);
- upload (from the pod): `clsact` on the same interface; on its ingress hook one u32 per internal CIDR on the
  *destination* with no action (the packet goes on untouched), then a match-all u32 with `mirred egress
  redirect` to the pod's IFB, which carries the same HTB/bfifo as the download side (HTB, not TBF: TBF's rate
  is 32-bit bytes/s in pyroute2, HTB has rate64).

Ownership is by constants, so a restart finds its own objects and adds no duplicates: the root handle
`7a17:`, the filter priorities `PRIO_*` and the IFB name prefix. Anything else on a pod interface's root or
ingress hook (a CNI bandwidth plugin, an eBPF CNI's programs) is *foreign* and left alone.

Implementations: `agent.host.tc_netlink.NetlinkTc` (the kernel, through pyroute2) and
`agent.host.tc_simulated.SimulatedTc` (an in-memory twin with the same ownership rules).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ROOT = 0x7A170000  # our HTB's handle, on pod interfaces and IFBs
LIMITED = 0x7A170001  # the limited class (HTB default 1)
LEAF = 0x7A180000  # byte-limited fifo under the limited class
CLSACT = 0xFFFF0000
CLSACT_INGRESS = 0xFFFFFFF2
PRIO_V4, PRIO_V6, PRIO_REDIRECT = 0x7A10, 0x7A11, 0x7A1F
OUR_PRIOS = (PRIO_V4, PRIO_V6, PRIO_REDIRECT)
ETH_P_ALL, ETH_P_IP, ETH_P_IPV6 = 0x0003, 0x0800, 0x86DD
IFB_PREFIX = "gnas"
IFB_NAME = re.compile(r"^gnas[0-9a-f]{11}$")
QUANTUM = 60000  # bytes; one leaf per HTB, so quantum only has to be in the kernel's quiet range
MIN_BURST = 2 * 65536  # burst must cover two GSO skbs, or Gbit/s limits under-deliver (reference shaping.md §7)
MIN_QUEUE, MAX_QUEUE = 100_000, 16 << 20  # bfifo bytes: ~20 ms of the limit, within these bounds
# Root qdiscs an interface has when nobody configured one: not an owner to respect.
DEFAULT_ROOTS = frozenset({"noqueue", "pfifo_fast", "mq", "fq_codel", "pfifo", "noop"})


class TcError(Exception):
    """A netlink request failed; the message names the object."""


@dataclass(frozen=True)
class Link:
    """A network interface of the host namespace."""

    index: int
    name: str
    kind: str  # IFLA_INFO_KIND: "veth", "bridge", "ifb", ... ("" for physical devices)


@dataclass(frozen=True)
class Exemption:
    """One internal network as a u32 match: (mask, value, offset) words, offsets from the network header."""

    family: int
    words: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class DeviceShaping:
    """What the shaping objects on one interface look like now (only ours are described in detail)."""

    download_bps: int | None = None  # our HTB's limited rate, None when our HTB is absent
    download_exempt: frozenset[Exemption] = frozenset()
    download_leaf: bool = False  # the bfifo under the limited class is there
    upload_ifb: int | None = None  # ifindex our redirect filter sends to, None when absent
    upload_exempt: frozenset[Exemption] = frozenset()
    foreign: str = ""  # a tc owner that is not us (root qdisc or ingress-hook filters), described


@dataclass(frozen=True)
class IfbState:
    """One of our IFBs."""

    name: str
    index: int
    rate_bps: int | None  # our HTB's rate on it, None when absent
    leaf: bool = False
    up: bool = False


@dataclass(frozen=True)
class ShaperCounters:
    """Bytes and packets sent and packets dropped by one limited class's leaf (L2 bytes, GSO segments)."""

    bytes: int = 0
    drops: int = 0


@dataclass
class TcState:
    """Every object of ours in the namespace: shaped interfaces and IFBs (plus leaf counters)."""

    devices: dict[int, DeviceShaping] = field(default_factory=dict)
    ifbs: dict[str, IfbState] = field(default_factory=dict)
    counters: dict[int, ShaperCounters] = field(default_factory=dict)  # by ifindex (pod interface or IFB)
    foreign: dict[int, str] = field(default_factory=dict)  # interfaces with another tc owner and none of ours


def exemptions(networks: Iterable[Network], *, source: bool) -> tuple[Exemption, ...]:
    """u32 words matching each network's source (download side) or destination (upload side) address."""
    out: list[Exemption] = []
    for net in networks:
        family = net.version
        base = (12 if source else 16) if family == 4 else (8 if source else 24)
        mask_bits = int(net.netmask)
        value = int(net.network_address)
        width = 32 if family == 4 else 128
        words: list[tuple[int, int, int]] = []
        for word in range(width // 32):
            shift = width - 32 * (word + 1)
            mask = (mask_bits >> shift) & 0xFFFFFFFF
            if mask:
                words.append((mask, (value >> shift) & mask, base + 4 * word))
        if not words:  # a /0 matches everything of the family: one all-zero word
            words.append((0, 0, base))
        out.append(Exemption(family, tuple(words)))
    return tuple(out)


def burst_bytes(rate_bps: int) -> int:
    """Token-bucket depth: at least two GSO skbs, else 2 ms at the rate."""
    return max(MIN_BURST, rate_bps // 8 // 500)


def queue_bytes(rate_bps: int) -> int:
    """Leaf queue in bytes: about 20 ms at the rate (bytes, not packets: GSO skbs are up to 64 KB each)."""
    return min(MAX_QUEUE, max(MIN_QUEUE, rate_bps // 8 // 50))


class TcPort(Protocol):
    """What shaping needs from the machine's traffic control."""

    def host_interface(self, ip: str) -> Link | None:
        """The host-side interface a pod IP is reached through (the routed veth, or the bridge port holding
        the pod's MAC); None when not found (yet)."""

    def link(self, index: int) -> Link | None:
        """The interface with this index, None if gone."""

    def read(self) -> TcState:
        """Our objects everywhere in the namespace, with their leaf counters, and the interfaces others own."""

    def counters(self, indexes: Iterable[int]) -> dict[int, ShaperCounters]:
        """The limited class's counters on each of `indexes` that has our shaper, by ifindex (the scrape's read:
        it touches only these interfaces)."""

    def device(self, index: int) -> DeviceShaping:
        """One interface's shaping objects, foreign owners included."""

    def shape_download(self, index: int, rate_bps: int, exempt: Sequence[Exemption]) -> None:
        """Install (or replace) the download shaper on `index`."""

    def set_download_rate(self, index: int, rate_bps: int) -> None:
        """Change the limited class's rate in place (counters and queue kept)."""

    def unshape_download(self, index: int) -> None:
        """Remove our HTB root from `index` (nothing when it is not ours)."""

    def ensure_ifb(self, name: str, rate_bps: int) -> int:
        """Create the IFB if missing, bring it up, give it the HTB shaper at `rate_bps`; its index."""

    def shape_upload(self, index: int, ifb_index: int, exempt: Sequence[Exemption]) -> None:
        """Install (or replace) the upload redirect from `index`'s ingress hook to the IFB."""

    def unshape_upload(self, index: int) -> None:
        """Remove our filters from `index`'s ingress hook, and the hook when nothing else uses it."""

    def delete_ifb(self, name: str) -> None:
        """Delete one of our IFBs (after the redirect into it is gone)."""

    def close(self) -> None:
        """Release the netlink socket."""
