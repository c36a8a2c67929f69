"""What one counting program compares (`Spec`): hook direction, link-layer length, the internal CIDRs, the node's
addresses, the prefix the pods share and which families count through the index (slots.py). Equal inputs give
one program name, so the layout swaps a hook's program exactly when what it compares changes."""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

INGRESS, EGRESS = "ingress", "egress"
MAX_POD_PREFIX = {4: 24, 6: 112}  # the pods' shared prefix is widened to this at least (fewer program swaps)


@dataclass(frozen=True)
class Spec:
    """What one program counts: its hook direction, link-layer header length, and the addresses it compares."""

    direction: str
    l2_len: int
    families: tuple[int, ...]
    internal: tuple[Network, ...]
    local: tuple[Address, ...] = ()  # the node's addresses (ingress only)
    pods: tuple[Network, ...] | None = None  # per family, the prefix every pod address shares (None: unknown)
    index: tuple[tuple[int, int], ...] = ()  # (family, generation) of the families counted through the index

    @property
    def name(self) -> str:
        """The program's name (15 characters at most): direction, and a digest of everything it compares."""
        text = f"{self.direction}|{self.l2_len}|{self.families}|{sorted(map(str, self.internal))}|" \
               f"{sorted(map(str, self.local))}|{None if self.pods is None else sorted(map(str, self.pods))}" \
               f"{f'|{self.index}' if self.index else ''}"
        return f"gna_{'in' if self.direction == INGRESS else 'eg'}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def spec(direction: str, l2_len: int, families: Iterable[int], internal: Iterable[Network],
         local: Iterable[Address] = (), *, pods: Iterable[Address] | None = None,
         index: Mapping[int, int] | None = None) -> Spec:
    """A Spec with its CIDRs collapsed and addresses sorted, so equal inputs give one program name. `pods`: every
    address the pods map holds (None: unknown, every address is looked up); `index`: family -> generation of the
    families whose pods all hold a slot (slots.Slots.modes), counted through the index instead of the hash."""
    fams = tuple(sorted(set(families)))
    nets = [n for n in internal if n.version in fams]
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    collapsed: list[Network] = [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]
    addrs = sorted({a for a in local if a.version in fams and not (a.version == 6 and a.is_link_local)},
                   key=lambda a: (a.version, int(a)))
    prefixes = None if pods is None else pod_prefixes(pods, fams)
    indexed = tuple(sorted((f, g) for f, g in (index or {}).items()
                           if f in fams and prefixes is not None and any(n.version == f for n in prefixes)))
    return Spec(direction, l2_len, fams, tuple(collapsed), tuple(addrs) if direction == INGRESS else (), prefixes,
                indexed)


def pod_prefixes(pods: Iterable[Address], families: Iterable[int]) -> tuple[Network, ...]:
    """Per family, the longest prefix all the pods' addresses share (none for a family without pods). A pod's
    addresses come from the node's pod CIDR, so this is about that CIDR: an address outside it is not looked up,
    which takes the hash lookup of a forwarded packet's internet (or remote pod) side off the path (§8)."""
    out: list[Network] = []
    for family in sorted(set(families)):
        values = [int(a) for a in pods if a.version == family]
        if not values:
            continue
        kind = ipaddress.IPv4Network if family == 4 else ipaddress.IPv6Network
        bits = kind(0).max_prefixlen
        prefix = bits - (min(values) ^ max(values)).bit_length()  # what min and max share, everything between does
        prefix = min(prefix, MAX_POD_PREFIX[family])  # so the first pods do not each swap programs
        out.append(kind((min(values) >> (bits - prefix) << (bits - prefix), prefix)))  # not ip_network: ::/0 is v6
    return tuple(out)
