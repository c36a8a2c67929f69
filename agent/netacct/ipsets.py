"""The ipsets netacct owns: the internal set and the per-pod counted sets, and how to bring them in line.

Why sets: the per-packet cost must not grow with the number of pods. One constant rule per direction and class
matches a `hash:ip counters` set (an O(1) hash lookup), and the set element's own counter is the pod's counter.
An address is in every counted set of its family, so the four sets (receive/transmit x internet/cluster) give
each pod IP four independent counters. The internal set is a `hash:net` (no counters): changing the cluster
ranges edits its members and never a rule.

Set names are constants built from safe identifiers; pod names and namespaces never appear in a set name or on
a command line. Only members do, and they are formatted from validated `ipaddress` objects.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.host.ipset_netlink import FLAG_WITH_COUNTERS, SetDump

PREFIX = "gna-"
INTERNAL = "internal"
COUNTED = ("rx-inet", "tx-inet", "rx-clus", "tx-clus")
ROLES = (INTERNAL, *COUNTED)
_INET = {4: ("inet", socket.AF_INET), 6: ("inet6", socket.AF_INET6)}

Member = tuple[bytes, int]  # packed address, prefix length (32/128 for plain addresses)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def set_name(role: str, family: int) -> str:
    """e.g. gna-rx-inet4, gna-internal6."""
    return f"{PREFIX}{role}{family}"


def all_names(families: Iterable[int]) -> list[str]:
    """Every set name netacct uses for these families."""
    return [set_name(role, family) for family in families for role in ROLES]


def is_ours(name: str) -> bool:
    """Whether a set name is one netacct creates (cleanup removes exactly these)."""
    return name in all_names((4, 6))


def _create_line(role: str, family: int) -> str:
    kind = "hash:net" if role == INTERNAL else "hash:ip"
    return f"create {set_name(role, family)} {kind} family {_INET[family][0]}" + (
        "" if role == INTERNAL else " counters")


def compatible(role: str, family: int, dump: SetDump) -> bool:
    """Whether an existing set has the type, family and counters this version needs."""
    kind = "hash:net" if role == INTERNAL else "hash:ip"
    counters = bool(dump.flags & FLAG_WITH_COUNTERS)
    return dump.type_name == kind and dump.family == _INET[family][1] and counters == (role != INTERNAL)


def internal_members(networks: Iterable[Network], family: int) -> set[Member]:
    """Members of the internal set; /0 becomes two /1 halves (hash:net cannot hold a /0)."""
    out: set[Member] = set()
    for net in networks:
        if net.version != family:
            continue
        halves: list[Network] = list(net.subnets(prefixlen_diff=1)) if net.prefixlen == 0 else [net]
        out.update((half.network_address.packed, half.prefixlen) for half in halves)
    return out


def member_text(member: Member, role: str) -> str:
    """How ipset spells a member: an address, or address/prefix in the internal set."""
    address = ipaddress.ip_address(member[0])
    return f"{address}/{member[1]}" if role == INTERNAL else str(address)


@dataclass
class SetPlan:
    """What one sync changes in the sets: the restore payload and the members it adds and removes."""

    payload: str = ""
    added: dict[str, set[Member]] = field(default_factory=dict)
    removed: dict[str, set[Member]] = field(default_factory=dict)
    carried: dict[str, dict[Member, tuple[int, int]]] = field(default_factory=dict)  # elements created holding these


def plan(current: Mapping[str, SetDump | None], pod_members: Mapping[int, set[Member]],
         networks: Iterable[Network], families: Iterable[int],
         carry: Mapping[tuple[str, int], Mapping[Member, tuple[int, int]]] | None = None, *,
         restore: Mapping[str, Mapping[Member, tuple[int, int]]] | None = None) -> SetPlan:
    """Create missing sets and add/remove members so that the sets hold exactly what is desired.

    `current` holds a dump per set (None: the set does not exist); `pod_members` the pod addresses per family;
    `carry` (a migration's counts per (role, family) and member) preloads the elements of sets this plan creates
    (`add SET ADDR packets N bytes M`; never on an existing set, where `-exist` would overwrite its counters);
    `restore` (per set name) gives the members it adds their counters' values (a repair of deleted elements).
    """
    networks = list(networks)
    result = SetPlan()
    lines: list[str] = []
    for family in families:
        for role in ROLES:
            name = set_name(role, family)
            want = internal_members(networks, family) if role == INTERNAL else pod_members.get(family, set())
            dump = current.get(name)
            have = set(dump.members) if dump is not None else set()
            if dump is None:
                lines.append(_create_line(role, family))
            add, remove = want - have, have - want
            carried = dict((restore or {}).get(name, {}))
            carried.update((carry or {}).get((role, family), {}) if dump is None else {})
            lines.extend(f"del {name} {member_text(m, role)}" for m in sorted(remove))
            for member in sorted(add):
                value = carried.get(member)
                lines.append(f"add {name} {member_text(member, role)}"
                             + (f" packets {value[0]} bytes {value[1]}" if value else ""))
                if value:
                    result.carried.setdefault(name, {})[member] = value
            if add:
                result.added[name] = add
            if remove:
                result.removed[name] = remove
    result.payload = "".join(line + "\n" for line in lines)
    return result


def destroy_payload(existing: Iterable[str]) -> str:
    """Lines that flush and destroy every netacct set among `existing` names (and nothing else)."""
    ours = sorted(name for name in existing if is_ours(name))
    return "".join(f"flush {name}\ndestroy {name}\n" for name in ours)
