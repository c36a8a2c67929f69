"""The native nftables layout of netacct: one table of our own, and the `nft -f` transaction that keeps it in line.

Why native: the iptables layout's set matches run through nft_compat (xt_set) on iptables-nft, which cost ~25 % of
64-byte forwarding (README, Performance). Here every match is a native set lookup and every count a native
counter, in one table nobody else writes:

    table inet gpu_node_agent_netacct
      set internal4 / internal6       interval sets of the internal CIDRs (no counters)
      set rx_inet4, tx_inet4, ...     the pods' addresses, one set per direction x class, each element has a counter
      counter cluster_in_host4, ...   named counters for the node series (traffic x direction x scope x family)
      chain input / output / forward  base chains, priority -300, policy accept; no drop, only return/goto
      chain fwd4_from_cluster, ...    forwarded traffic by source class, then leaf chains by destination class

Counts live only in named counters and set elements, never in rules: a rule or chain can be rewritten (flush and
re-add, in the same transaction) without losing a count, and a restart adopts the table as it is (`add` of an
existing, identical set or counter is a no-op). Sets whose definition differs, or base chains on another hook or
priority, make the plan rebuild the table (delete and create in one transaction); the engine then marks this
layout's counters as restarted so exported totals stay monotonic. A table created by a migration is created
holding the carried totals (carry), with a marker counter beside them until the old layout is gone.

Priority -300 (raw): below mangle (-150), NAT (-100), kube-proxy's nftables chains (-110 and 0) and filter (0). A
`drop` in any base chain is final for the packet, so a chain that runs earlier could hide traffic; an `accept`
does not stop later base chains. -300 also sits before conntrack (-200) and DNAT on output, so it sees the same
addresses as the iptables layout's mangle chains did. Chains below -300 (defrag at -400, or someone's own) can
still drop first; a counting table cannot outrank every possible chain.

Element counters of a plain (non-dynamic) set are updated by the lookup itself; `auto` checks that with a probe
packet (nft_probe) instead of trusting a kernel version. Everything that varies in a payload is formatted from
`ipaddress` objects; pod names never reach it.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.host.nft_netlink import SET_INTERVAL, ChainInfo, Counts, Elements, Range, SetInfo, merge
from agent.netacct import ipsets
from agent.netacct.carry import Carry, rule_keys

TABLE = "gpu_node_agent_netacct"
PRIORITY = -300
HOOKS = {"input": 1, "forward": 2, "output": 3}  # NF_INET_LOCAL_IN, NF_INET_FORWARD, NF_INET_LOCAL_OUT
KEY_TYPES = {4: 7, 6: 8}  # nft's ipv4_addr / ipv6_addr data types, as stored in NFTA_SET_KEY_TYPE
_TYPE_NAMES = {4: "ipv4_addr", 6: "ipv6_addr"}
_PROTO = {4: "ip", 6: "ip6"}
COMMENT = "gpu-node-agent"
# A named counter created in the same transaction as a table preloaded by a migration, deleted once the old layout
# is gone: found at a start while the old layout is still there, it says the old counts are in this table already.
CARRY_MARKER = "carried_from_iptables"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def set_name(role: str, family: int) -> str:
    """e.g. rx_inet4, internal6 (nft names cannot hold '-' unquoted)."""
    return f"{role.replace('-', '_')}{family}"


def counter_name(key: str, family: int) -> str:
    """`traffic=cluster-in scope=host`, 4 -> cluster_in_host4."""
    fields = dict(part.split("=", 1) for part in key.split())
    return f"{fields['traffic'].replace('-', '_')}_{fields['scope']}{family}"


def counter_keys(families: Iterable[int]) -> dict[str, tuple[int, str]]:
    """Every named counter: name -> (family, rule key as the iptables layout spells it)."""
    return {counter_name(key, family): (family, key) for family in families for key in rule_keys()}


@dataclass(frozen=True)
class NftRule:
    """One rule: its chain, its text, and the comment that identifies this exact text."""

    chain: str
    text: str

    @property
    def comment(self) -> str:
        """`gpu-node-agent id=<hash of chain and text>`: a changed rule is found without parsing nft's output."""
        return f"{COMMENT} id={hashlib.sha256(f'{self.chain}|{self.text}'.encode()).hexdigest()[:10]}"

    def line(self) -> str:
        """The rule as an `add rule` command."""
        return f'add rule inet {TABLE} {self.chain} {self.text} comment "{self.comment}"'


INLINE_LIMIT = 8  # internal CIDRs per family matched by prefix in the rules; more go through the interval set


@dataclass(frozen=True)
class Classifier:
    """How one family's rules tell cluster from internet, and which pod lookups can ever match.

    Why not always the interval set: on this kernel a lookup in an interval set (an rbtree) costs about five
    times a prefix compare, and a forwarded packet needs two (bench/nft_shapes.py: two interval lookups 0.90 of
    no accounting for 64-byte UDP, two inline prefixes 0.98). Clusters name a handful of CIDRs, so up to
    INLINE_LIMIT are compared inline; the set is kept filled either way (it is what other tools can read).
    Rules hold no counts, so rewriting them when the CIDRs change loses nothing.
    """

    cidrs: tuple[str, ...] | None  # the collapsed internal CIDRs compared inline; None: look up the interval set
    pods_internal: bool  # every pod address of this family is internal: an internet address is never a pod's


def classifiers(networks: Iterable[Network], pod_members: Mapping[int, set[ipsets.Member]],
                families: Iterable[int]) -> dict[int, Classifier]:
    """The classifier of each family for these internal networks and pod addresses."""
    networks = list(networks)
    out = {}
    for family in families:
        cidrs = _collapsed(networks, family)
        nets = [n for n in networks if n.version == family]
        inside = all(any(ipaddress.ip_address(m[0]) in n for n in nets) for m in pod_members.get(family, set()))
        out[family] = Classifier(tuple(cidrs) if len(cidrs) <= INLINE_LIMIT else None, inside)
    return out


def desired_rules(shape: Mapping[int, Classifier]) -> dict[str, list[NftRule]]:
    """Rules per chain (base chains first). Each packet costs one internal-or-not test per address (inline
    prefixes or one interval lookup) and at most one counted-set lookup per direction: a lookup that matches
    bumps its element's counter, as ipset's did, so each counted set is looked up at most once per packet.

    Host traffic: a packet from (to) an internal address is counted and leaves the chain (`return` in a base
    chain is its policy, accept, which does not stop other base chains); anything else of that family is
    internet. Forwarded traffic: the source class picks one of two chains, the destination class one of two
    leaf chains, and each leaf counts exactly what the iptables layout's six FORWARD rules count for that pair.
    Where every pod address is internal, a lookup of an internet-side address in a pod set cannot match and is
    left out (the node's counter stays); a pod outside the internal CIDRs brings those lookups back."""
    chains: dict[str, list[NftRule]] = {"input": [NftRule("input", 'iifname "lo" return')],
                                        "output": [NftRule("output", 'oifname "lo" return')], "forward": []}
    for family, classifier in shape.items():
        ip = _PROTO[family]
        s = {role: f"@{set_name(role, family)}" for role in ipsets.COUNTED}

        def internal(address: str, then: str, fam: int = family, c: Classifier = classifier) -> list[str]:
            """Rules `<address> is internal -> then`: one per inline prefix, or one set lookup."""
            prefixes = [f"@{set_name(ipsets.INTERNAL, fam)}"] if c.cidrs is None else list(c.cidrs)
            return [f"{_PROTO[fam]} {address} {prefix} {then}" for prefix in prefixes]

        def count(key: str, fam: int = family) -> str:
            return f'counter name "{counter_name(key, fam)}"'

        nfproto = f"meta nfproto ipv{family}"
        chains["input"] += [NftRule("input", text) for text in
                            internal("saddr", f"{count('traffic=cluster-in scope=host')} return")]
        chains["input"].append(NftRule("input", f"{nfproto} {count('traffic=internet-in scope=host')} return"))
        chains["output"] += [NftRule("output", text) for text in
                             internal("daddr", f"{count('traffic=cluster-out scope=host')} return")]
        chains["output"].append(NftRule("output", f"{nfproto} {count('traffic=internet-out scope=host')} return"))
        # Internet traffic is counted for the node whether or not a pod owns the address; the pod's own set
        # lookup follows the counter, so its element counts the same packets. Cluster traffic is counted only
        # for this node's pods, as in the iptables layout.
        inet_in, inet_out = count("traffic=internet-in scope=pod"), count("traffic=internet-out scope=pod")
        clus_in = f"{ip} daddr {s['rx-clus']} {count('traffic=cluster-in scope=pod')}"
        clus_out = f"{ip} saddr {s['tx-clus']} {count('traffic=cluster-out scope=pod')}"
        inet_in_pod, inet_out_pod = f"{inet_in} {ip} daddr {s['rx-inet']}", f"{inet_out} {ip} saddr {s['tx-inet']}"
        far = classifier.pods_internal  # the internet-side address of a packet is never a pod's
        from_c, from_i = f"fwd{family}_from_cluster", f"fwd{family}_from_internet"
        leaves = {f"fwd{family}_cluster_cluster": [clus_in, clus_out],
                  f"fwd{family}_cluster_internet": ([] if far else [clus_in]) + [inet_out_pod],
                  f"fwd{family}_internet_cluster": [inet_in_pod] + ([] if far else [clus_out]),
                  f"fwd{family}_internet_internet": [inet_in, inet_out] if far else [inet_in_pod, inet_out_pod]}
        chains["forward"] += [NftRule("forward", text) for text in internal("saddr", f"goto {from_c}")]
        chains["forward"].append(NftRule("forward", f"{nfproto} goto {from_i}"))
        for origin in ("cluster", "internet"):
            chain = f"fwd{family}_from_{origin}"
            chains[chain] = [NftRule(chain, text) for text in
                             internal("daddr", f"goto fwd{family}_{origin}_cluster")]
            chains[chain].append(NftRule(chain, f"goto fwd{family}_{origin}_internet"))
        chains.update({name: [NftRule(name, text) for text in texts] for name, texts in leaves.items()})
    return chains


def desired_sets(families: Iterable[int]) -> dict[str, tuple[int, str, int]]:
    """Set name -> (family, role, key type)."""
    return {set_name(role, family): (family, role, KEY_TYPES[family]) for family in families for role in ipsets.ROLES}


def internal_ranges(networks: Iterable[Network], family: int) -> list[Range]:
    """The internal CIDRs of one family as merged address ranges (what the kernel's interval set holds)."""
    return merge([(int(n.network_address), int(n.broadcast_address) + 1) for n in networks if n.version == family])


def _collapsed(networks: Iterable[Network], family: int) -> list[str]:
    nets = [n for n in networks if n.version == family]
    return [str(n) for n in ipaddress.collapse_addresses(nets)]  # type: ignore[type-var]


@dataclass
class NftState:
    """What one read found: set definitions (None: no table), chains, named counters, and set elements."""

    sets: dict[str, SetInfo] | None
    chains: dict[str, ChainInfo] = field(default_factory=dict)
    counters: dict[str, Counts] = field(default_factory=dict)
    elements: dict[str, Elements | None] = field(default_factory=dict)

    @property
    def exists(self) -> bool:
        """Whether the table exists."""
        return self.sets is not None


@dataclass
class NftPlan:
    """One sync's transaction (empty: nothing to change) and whether it re-creates the table."""

    payload: str = ""
    rebuilt: bool = False
    rewritten_chains: list[str] = field(default_factory=list)


def _set_ok(info: SetInfo, family: int, role: str) -> bool:
    interval = bool(info.flags & SET_INTERVAL)
    wanted_interval = role == ipsets.INTERNAL
    return info.key_type == KEY_TYPES[family] and interval == wanted_interval and info.counter == (not interval)


def _chain_ok(info: ChainInfo, name: str) -> bool:
    return info.hook == HOOKS[name] and info.priority == PRIORITY and info.kind == "filter"


def _set_line(name: str, family: int, role: str) -> str:
    extra = "flags interval;" if role == ipsets.INTERNAL else "counter;"
    return f"add set inet {TABLE} {name} {{ type {_TYPE_NAMES[family]}; {extra} }}"


def _counted(value: Counts | None) -> str:
    """` { packets N bytes M }` for a counter created holding a carried value."""
    return f" {{ packets {value[0]} bytes {value[1]} }}" if value else ""


def _element(member: bytes, value: Counts | None) -> str:
    """An element, with its counter's initial value when one is carried."""
    text = str(ipaddress.ip_address(member))
    return f"{text} counter packets {value[0]} bytes {value[1]}" if value else text


def _elements(verb: str, name: str, items: Iterable[str]) -> list[str]:
    items = list(items)
    return [f"{verb} element inet {TABLE} {name} {{ {', '.join(items)} }}"] if items else []


def plan(state: NftState, pod_members: Mapping[int, set[ipsets.Member]], networks: Iterable[Network],
         families: Iterable[int], carry: Carry | None = None, *, marker: bool = True,
         restore: Mapping[str, Mapping[ipsets.Member, Counts]] | None = None) -> NftPlan:
    """One transaction that makes the table exactly what is desired, touching only what differs. `carry` (a
    migration's counts, or a repair's) preloads the counters and elements of a table created by this transaction,
    with the marker counter beside them when `marker`; an existing table keeps its own counts and `carry` is
    ignored. `restore` gives elements this transaction adds to an existing set their counters' values (a repair of
    elements someone else deleted)."""
    families, networks = tuple(families), list(networks)
    carry = carry if not state.exists else None
    carried_rules = carry.rules if carry else {}
    carried_elements = carry.elements if carry else {}
    sets, counters = desired_sets(families), counter_keys(families)
    rules = desired_rules(classifiers(networks, pod_members, families))
    result = NftPlan()
    current = state if state.exists else NftState(sets={})
    bad = [n for n, (fam, role, _) in sets.items() if n in (current.sets or {})
           and not _set_ok((current.sets or {})[n], fam, role)]
    bad += [n for n in HOOKS if n in current.chains and not _chain_ok(current.chains[n], n)]
    lines: list[str] = []
    if bad:
        lines.append(f"delete table inet {TABLE}")
        current, result.rebuilt = NftState(sets={}), True
    have_sets = current.sets or {}
    lines.append(f"add table inet {TABLE}")
    lines += [_set_line(n, fam, role) for n, (fam, role, _) in sets.items() if n not in have_sets]
    lines += [f"add counter inet {TABLE} {n}{_counted(carried_rules.get(fam, {}).get(key))}"
              for n, (fam, key) in counters.items() if n not in current.counters]
    if carry is not None and marker:
        lines.append(f"add counter inet {TABLE} {CARRY_MARKER}")
    # Every chain exists before any rule jumps to it; base chains are listed first and filled last.
    for name in [n for n in rules if n not in current.chains]:
        hook = f" {{ type filter hook {name} priority {PRIORITY}; policy accept; }}" if name in HOOKS else ""
        lines.append(f"add chain inet {TABLE} {name}{hook}")
    for name in sorted(rules, key=lambda n: n in HOOKS):
        chain_rules = rules[name]
        if name in current.chains:
            if current.chains[name].comments == [r.comment for r in chain_rules]:
                continue
            lines.append(f"flush chain inet {TABLE} {name}")
        lines += [r.line() for r in chain_rules]
        result.rewritten_chains.append(name)
    for name, (family, role, _) in sets.items():
        found = current.elements.get(name) if name in have_sets else None
        if role == ipsets.INTERNAL:
            if found is None or found.ranges != internal_ranges(networks, family):
                if found is not None:
                    lines.append(f"flush set inet {TABLE} {name}")
                lines += _elements("add", name, _collapsed(networks, family))
            continue
        want = {m[0] for m in pod_members.get(family, set())}
        have = set(found.counted) if found is not None else set()
        lines += _elements("delete", name, (str(ipaddress.ip_address(m)) for m in sorted(have - want)))
        given = [*(restore or {}).get(name, {}).items(), *carried_elements.get((role, family), {}).items()]
        carried = {m[0]: v for m, v in given}
        lines += _elements("add", name, (_element(m, carried.get(m)) for m in sorted(want - have)))
    # What an older configuration left (IPv6 turned off, a chain of another version): rules first, then objects.
    stale = sorted(set(current.chains) - set(rules))  # flush all before deleting any: they may jump to each other
    lines += [f"flush chain inet {TABLE} {name}" for name in stale]
    lines += [f"delete chain inet {TABLE} {name}" for name in stale]
    lines += [f"delete set inet {TABLE} {n}" for n in sorted(set(have_sets) - set(sets))]
    lines += [f"delete counter inet {TABLE} {n}" for n in sorted(set(current.counters) - set(counters))]
    if state.exists and len(lines) == 1 and not result.rebuilt:
        return result  # only `add table`: nothing differs
    result.payload = "".join(line + "\n" for line in lines)
    return result


def removal_payload() -> str:
    """The transaction that removes the whole table (sets, counters and chains go with it)."""
    return f"delete table inet {TABLE}\n"
