"""Repairs of netacct's kernel state after someone else changed it, and the counts they restore.

Why count and warn: a third party (an operator's `nft flush ruleset`, another agent's cleanup) deleting the table,
flushing a chain or removing a pod's element silently stops counting until the next sync puts it back, and the
kernel counters it deleted held part of the exported totals. The engine re-creates what was removed holding the
last raw values it read (the counter book keeps them for objects that vanished), so the totals stay in the kernel
and a later restart continues from them; only what was counted between the engine's last read and the removal is
lost. Each repair is a warning naming the object and a count in `gpu_node_agent_netacct_repairs_total{what}`.

A repair is only what differs from the state this process installed itself: the first sync of a process
(install, upgrade, a migration) changes things without counting them.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from collections.abc import Iterable, Mapping

from agent.host.ipset_netlink import SetDump
from agent.host.netfilter import Host
from agent.netacct import ipsets, rules
from agent.netacct.counters import CounterBook, Counts, Source

log = logging.getLogger(__name__)

# The `what` label values, each always exported (zero until it happens).
KINDS = ("nft_table", "nft_chain", "nft_element", "iptables_chain", "iptables_rule", "iptables_jump", "ipset",
         "ipset_element", "ebpf_map", "ebpf_link", "ebpf_element", "ebpf_index")


class Repairs:
    """Repair counts per kind (read by scrapes in other threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(KINDS, 0)

    def note(self, what: str, objects: Iterable[str]) -> None:
        """Someone else removed or changed `objects` (of kind `what`) and the engine put them back."""
        names = sorted(objects)
        if not names:
            return
        with self._lock:
            self._counts[what] += len(names)
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        log.warning("netacct: repaired %s changed or removed by someone else: %s (re-created holding the counts "
                    "last read; traffic between that read and the change is lost)", what.replace("_", " "), shown)

    def counts(self) -> dict[str, int]:
        """Repairs so far per kind."""
        with self._lock:
            return dict(self._counts)


Values = dict[ipsets.Member, Counts]


def missing_elements(name: str, want: Iterable[ipsets.Member], have: Iterable[bytes],
                     vanished: Mapping[str, Mapping[ipsets.Member, Counts]]) -> tuple[list[str], Values]:
    """Members of set `name` the engine installed that are gone now: their names (for the warning) and the values
    to re-create them with (the last raw values read, where the book has them)."""
    present = set(have)
    gone = [m for m in want if m[0] not in present]
    values = {m: v for m in gone if (v := vanished.get(name, {}).get(m)) is not None}
    return [f"{name} {ipaddress.ip_address(m[0])}" for m in gone], values


def sets_to_restore(repairs: Repairs, sets: Mapping[str, SetDump | None], members: Mapping[int, set[ipsets.Member]],
                    synced: Mapping[int, set[ipsets.Member]], *, families: Iterable[int],
                    vanished: Mapping[str, Mapping[ipsets.Member, Counts]]) -> dict[str, Values]:
    """The iptables layout's sets or elements someone else removed (of those the last sync installed): noted, and
    the values to re-create the elements with."""
    restore: dict[str, Values] = {}
    gone: list[str] = []
    for family in families:
        for role in ipsets.COUNTED:
            name = ipsets.set_name(role, family)
            dump = sets.get(name)
            want = members.get(family, set()) & synced.get(family, set())
            names, restore[name] = missing_elements(name, want, (m[0] for m in dump.members) if dump else (),
                                                    vanished)
            if dump is None:
                repairs.note("ipset", [name])
            else:
                gone += names
        if sets.get(ipsets.set_name(ipsets.INTERNAL, family)) is None:
            repairs.note("ipset", [ipsets.set_name(ipsets.INTERNAL, family)])
    repairs.note("ipset_element", gone)
    return restore


def rule_values(repairs: Repairs, state: rules.Mangle, family: int,
                vanished: Mapping[tuple[Source, str], Counts]) -> dict[str, Counts]:
    """Note what someone else changed in one family's chains; the values each rule of a chain that will be
    rewritten is re-created with: its current count, or the last one read before it was deleted."""
    want = rules.desired(family)
    current = rules.counters(state)
    for hook, chain in rules.CHAINS.items():
        if chain not in state.chains:
            repairs.note("iptables_chain", [f"IPv{family} {chain}"])
        elif [r.comment for r in state.in_chain(chain)] != [r.comment for r in want if r.chain == chain]:
            repairs.note("iptables_rule", [f"IPv{family} {chain}"])
        if not [r for r in state.jumps() if r.chain == hook and r.target == chain]:
            repairs.note("iptables_jump", [f"IPv{family} {hook} -> {chain}"])
    keys = {key for rule in want if (key := rules.key_of(rule.comment))}
    values = {key: current.get(key) or vanished.get((family, key), (0, 0)) for key in keys}
    return {key: value for key, value in values.items() if value != (0, 0)}


def move_into_ipv4(host: Host, mode: str, book: CounterBook, dropped: Mapping[str, Counts]) -> None:
    """ip6tables-nft does not keep restored counters: the counts of repaired IPv6 rules go into the IPv4 rules of
    the same keys (each node series sums both families), rewriting their chains holding current + moved. Packets
    those IPv4 rules count between this read and the rewrite are lost, as in a migration's window."""
    state = rules.parse(host.save(mode, 4))
    current = rules.counters(state)
    book.observe_rules(4, current)  # absorb what they counted up to now
    chains = {r.chain for r in rules.desired(4) if rules.key_of(r.comment) in dropped}
    lines = [f":{chain} - [0:0]" for chain in sorted(chains)]
    written: dict[str, Counts] = {}
    for rule in rules.desired(4):
        if rule.chain in chains:
            key = rules.key_of(rule.comment) or ""
            now, moved = current.get(key, (0, 0)), dropped.get(key, (0, 0))
            written[key] = (now[0] + moved[0], now[1] + moved[1])
            lines.append(f"[{written[key][0]}:{written[key][1]}] {rule.line()}")
    host.restore(mode, 4, "*mangle\n" + "".join(line + "\n" for line in lines) + "COMMIT\n", counters=True)
    book.rules_restarted(4, written)
    book.rules_created_with(4, written)
