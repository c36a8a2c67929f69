"""The mangle chains netacct owns, and the `iptables-restore --noflush` payloads that keep them in line.

Layout (per family): one chain per hook, `GNA-NETACCT-IN|OUT|FWD`, each jumped to once from INPUT, OUTPUT and
FORWARD (inserted at position 1, so no earlier verdict hides traffic). The chains hold only counting rules
without a verdict, plus a loopback RETURN, and their number is constant: pods live in ipsets (see ipsets).
Host traffic is counted in IN/OUT, forwarded pod traffic in FWD, so the two never mix.

Every rule carries a comment `gpu-node-agent traffic=internet-in scope=host id=<hash>`, readable by other
iptables exporters. `traffic=`/`scope=` is the rule's stable identity (what its counter is exported as); `id=`
hashes the rule's full text, as Calico's `cali:<hash>` does, so a rule that changed in a newer agent is
detected without comparing iptables-save's spelling of matches. A chain whose comments already match is never
re-declared, because re-declaring a chain in a restore flushes it and resets its counters. The two rules that only
feed per-pod set counters say `pods=internet-in|out` instead of `traffic=`, so an exporter summing by `traffic=`
does not count forwarded internet traffic twice.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.netacct import ipsets

COMMENT = "gpu-node-agent"
JUMP_COMMENT = f"{COMMENT} jump"
CHAIN_PREFIX = "GNA-NETACCT-"
CHAINS = {"INPUT": "GNA-NETACCT-IN", "OUTPUT": "GNA-NETACCT-OUT", "FORWARD": "GNA-NETACCT-FWD"}
PER_POD = "pods="  # comment key of the rules that only feed per-pod set counters
# An empty chain that exists while a migration from the nft layout installs this one with preloaded counters
# (ipsets, then each family's rules: several commits). Found at a start while the nft table still exists, it says
# the install may be incomplete: the engine removes it and migrates again from the table.
MARKER = f"{CHAIN_PREFIX}CARRY"
# A second empty chain, created once every object holds its carry (the kernel kept every carried counter): found
# at a start while the old layout still exists, the install is complete and the old layout may already be half
# removed (the eBPF layout is removed link by link), so the engine finishes the migration rather than redoing it.
CARRIED = f"{CHAIN_PREFIX}CARRIED"
MARKERS = (MARKER, CARRIED)

_RULE = re.compile(r"^(?:\[(\d+):(\d+)\] )?-A (\S+) (.*)$")
_COMMENT = re.compile(r'--comment (?:"((?:[^"\\]|\\.)*)"|(\S+))')
_TARGET = re.compile(r"(?:^| )-j (\S+)$")
_ID = re.compile(r" id=[0-9a-f]+$")


@dataclass(frozen=True)
class Rule:
    """One counting rule: chain, matches, stable key (`traffic=... scope=...`) and optional target."""

    chain: str
    matches: str
    key: str
    target: str | None = None

    @property
    def comment(self) -> str:
        """The rule comment: prefix, key, and a hash of everything that defines the rule."""
        digest = hashlib.sha256(f"{self.chain}|{self.matches}|{self.key}|{self.target}".encode()).hexdigest()
        return f"{COMMENT} {self.key} id={digest[:8]}"

    def line(self) -> str:
        """The rule as an iptables-restore `-A` line."""
        target = f" -j {self.target}" if self.target else ""
        matches = f"{self.matches} " if self.matches else ""
        return f'-A {self.chain} {matches}-m comment --comment "{self.comment}"{target}'


def desired(family: int) -> list[Rule]:
    """The constant rule set of one family (six FWD rules, three per host chain)."""
    internal = ipsets.set_name(ipsets.INTERNAL, family)
    s = {role: ipsets.set_name(role, family) for role in ipsets.COUNTED}
    fin, fout, fwd = CHAINS["INPUT"], CHAINS["OUTPUT"], CHAINS["FORWARD"]
    return [
        Rule(fin, "-i lo", "skip=loopback-in", "RETURN"),
        Rule(fin, f"-m set --match-set {internal} src", "traffic=cluster-in scope=host"),
        Rule(fin, f"-m set ! --match-set {internal} src", "traffic=internet-in scope=host"),
        Rule(fout, "-o lo", "skip=loopback-out", "RETURN"),
        Rule(fout, f"-m set --match-set {internal} dst", "traffic=cluster-out scope=host"),
        Rule(fout, f"-m set ! --match-set {internal} dst", "traffic=internet-out scope=host"),
        # Forwarded traffic. Internet counts need no pod list (OpenAI's rules); cluster traffic has a direction
        # only relative to this node's pods, so it is counted on the pods' own sets. A counted set is always
        # the last match of its rule: ipset bumps an element's counter whenever it matches.
        Rule(fwd, f"-m set ! --match-set {internal} src", "traffic=internet-in scope=pod"),
        Rule(fwd, f"-m set ! --match-set {internal} dst", "traffic=internet-out scope=pod"),
        Rule(fwd, f"-m set --match-set {internal} src -m set --match-set {s['rx-clus']} dst",
             "traffic=cluster-in scope=pod"),
        Rule(fwd, f"-m set --match-set {internal} dst -m set --match-set {s['tx-clus']} src",
             "traffic=cluster-out scope=pod"),
        Rule(fwd, f"-m set ! --match-set {internal} src -m set --match-set {s['rx-inet']} dst",
             f"{PER_POD}internet-in"),
        Rule(fwd, f"-m set ! --match-set {internal} dst -m set --match-set {s['tx-inet']} src",
             f"{PER_POD}internet-out"),
    ]


@dataclass(frozen=True)
class SavedRule:
    """A rule line from `iptables-save -c`: its text after `-A CHAIN `, comment, target and counters."""

    chain: str
    text: str
    comment: str | None
    target: str | None
    packets: int
    octets: int


@dataclass
class Mangle:
    """The parts of a mangle save that netacct cares about."""

    chains: set[str] = field(default_factory=set)
    rules: list[SavedRule] = field(default_factory=list)

    def ours(self) -> set[str]:
        """Chains with netacct's prefix, wanted or stale."""
        return {c for c in self.chains if c.startswith(CHAIN_PREFIX)}

    def in_chain(self, chain: str) -> list[SavedRule]:
        """Rules of one chain, in order."""
        return [r for r in self.rules if r.chain == chain]

    def jumps(self) -> list[SavedRule]:
        """Rules anywhere that jump into a netacct chain."""
        return [r for r in self.rules if r.target and r.target.startswith(CHAIN_PREFIX)
                and not r.chain.startswith(CHAIN_PREFIX)]


def parse(save: str) -> Mangle:
    """Parse `iptables-save [-c] -t mangle` output (only the mangle table is read)."""
    state = Mangle()
    in_mangle = False
    for line in save.splitlines():
        if line.startswith("*"):
            in_mangle = line == "*mangle"
        elif not in_mangle:
            continue
        elif line.startswith(":"):
            state.chains.add(line[1:].split(" ", 1)[0])
        elif (m := _RULE.match(line)) is not None:
            comment = _COMMENT.search(m[4])
            target = _TARGET.search(m[4])
            state.rules.append(SavedRule(
                m[3], m[4], (comment[1] if comment[1] is not None else comment[2]) if comment else None,
                target[1] if target else None, int(m[1] or 0), int(m[2] or 0)))
    return state


def key_of(comment: str | None) -> str | None:
    """`gpu-node-agent traffic=internet-in scope=host id=1a2b3c4d` -> `traffic=internet-in scope=host`."""
    if not comment or not comment.startswith(COMMENT + " ") or comment == JUMP_COMMENT:
        return None
    return _ID.sub("", comment[len(COMMENT) + 1:])


def counters(state: Mangle) -> dict[str, tuple[int, int]]:
    """(packets, bytes) per rule key in netacct's chains (keys repeated by accident are summed)."""
    out: dict[str, tuple[int, int]] = {}
    for rule in state.rules:
        key = key_of(rule.comment) if rule.chain.startswith(CHAIN_PREFIX) else None
        if key is not None:
            packets, octets = out.get(key, (0, 0))
            out[key] = (packets + rule.packets, octets + rule.octets)
    return out


@dataclass
class RulePlan:
    """One family's changes: the restore payloads (in order) and the keys whose counters restart at 0."""

    payloads: list[str] = field(default_factory=list)
    reset_keys: set[str] = field(default_factory=set)
    carried: dict[str, tuple[int, int]] = field(default_factory=dict)  # keys created holding these (payload 0)


def _table(lines: Iterable[str]) -> str:
    body = list(lines)
    return "*mangle\n" + "".join(line + "\n" for line in body) + "COMMIT\n" if body else ""


def plan(state: Mangle, family: int, carry: Mapping[str, tuple[int, int]] | None = None,
         migrating: bool | None = None) -> RulePlan:
    """Bring one family's chains and jumps in line, touching only what differs. `carry` (a migration's counts per
    key) preloads the rules of chains this plan writes (`[packets:bytes]` lines, restored with `--counters`): a
    created chain (migration), or one rewritten after someone else changed it (repair); a chain left as it is keeps
    its own counts. The migration marker chain is kept while `migrating` (default: when `carry` is given)."""
    want = desired(family)
    migrating = carry is not None if migrating is None else migrating
    result = RulePlan()
    lines: list[str] = []
    for hook, chain in CHAINS.items():
        rules = [r for r in want if r.chain == chain]
        have = [r.comment for r in state.in_chain(chain)]
        if chain not in state.chains or have != [r.comment for r in rules]:
            lines.append(f":{chain} - [0:0]")  # creates it, or flushes it for a rewrite
            for rule in rules:
                key = key_of(rule.comment) or ""
                value = carry.get(key) if carry else None
                if value:
                    result.carried[key] = value
                lines.append(f"[{value[0]}:{value[1]}] {rule.line()}" if value else rule.line())
            result.reset_keys.update(k for r in rules if (k := key_of(r.comment)))
        jumps = [r for r in state.jumps() if r.chain == hook and r.target == chain]
        lines.extend(f"-D {hook} {r.text}" for r in jumps[1:])
        if not jumps:
            lines.append(f'-I {hook} 1 -m comment --comment "{JUMP_COMMENT}" -j {chain}')
    stale = state.ours() - set(CHAINS.values()) - (set(MARKERS) if migrating else set())
    removal = removal_payloads(state, stale)
    result.payloads = [p for p in (_table(lines), *removal) if p]
    return result


def marker_payload(create: bool, chains: Iterable[str] = (MARKER,)) -> str:
    """Create (or delete) migration marker chains (MARKER, CARRIED)."""
    return _table([f":{chain} - [0:0]" if create else f"-X {chain}" for chain in chains])


def removal_payloads(state: Mangle, chains: Iterable[str]) -> list[str]:
    """Two transactions removing `chains` (netacct's only): drop jumps and flush, then delete the chains."""
    chains = sorted(c for c in chains if c.startswith(CHAIN_PREFIX))
    if not chains:
        return []
    first = [f"-D {r.chain} {r.text}" for r in state.rules
             if r.target in chains and r.chain not in chains]
    first.extend(f":{chain} - [0:0]" for chain in chains)
    return [_table(first), _table(f"-X {chain}" for chain in chains)]
