"""The iptables layout (`layout.Layout`): mangle chains matching ipsets with counters, on either iptables backend.

The engine holds its lock around every call. Counts live in the ipset elements (per pod) and in the rules of
netacct's chains (per node series, under the same keys the nft layout's named counters use). The backend (nft or
legacy) is the configured one, or detected on first use from the kubelet's hint chains; while a migration away from
this layout waits for the pod list, it follows the backend whose mangle table holds the chains (the hint may have
moved since they were written). Removal covers both backends and both families, whatever the configuration says.

Carrying a migration's totals: elements are created holding them (`ipset restore`), rules with `[packets:bytes]`
lines restored with `--counters`; ip6tables-nft 1.8.9 drops the counters of IPv6 rule lines, so each node total is
carried in the IPv4 rule alone. A marker chain exists while a migration installs this layout (`begin_carry`), and
a second one once every object holds its carry (`holds_carry`: the old layout may be half removed, finish it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from agent.config.netacct import NetacctConfig
from agent.host.netfilter import FAMILIES, MODES, CommandError, Host, Snapshot
from agent.netacct import ipsets, repair, rules
from agent.netacct.carry import OldRaw
from agent.netacct.counters import CounterBook, Counts
from agent.netacct.layout import Desired, Members, NotReady, SyncError, sync_members
from agent.netacct.repair import Repairs

log = logging.getLogger(__name__)


class IptablesLayout:
    """netacct's mangle chains and ipsets in `host`'s namespace, accounted into `book`."""

    name = "iptables"

    def __init__(self, config: NetacctConfig, host: Host, book: CounterBook, *, families: Sequence[int],
                 networks: Sequence[ipsets.Network], repairs: Repairs) -> None:
        self.config = config
        self.host = host
        self.book = book
        self.families = tuple(families)
        self.networks = list(networks)
        self.repairs = repairs
        self._mode: str | None = None if config.backend == "auto" else config.backend
        self._carried = False  # this process's migration created the CARRIED marker

    @property
    def mode(self) -> str:
        """The iptables backend in use (detected on first use when configured as auto)."""
        if self._mode is None:
            self._mode = self.host.detect_mode(self.families)
            log.info("netacct: using the iptables-%s backend", self._mode)
        return self._mode

    @property
    def backend(self) -> str:
        """The backend in use, or unknown before it is detected."""
        return self._mode or "unknown"

    # -- reading ------------------------------------------------------------------------------------------------

    def _read(self, names: Sequence[str]) -> Snapshot:
        snap = self.host.snapshot(self.mode, self.families, names)
        for family, text in snap.saves.items():
            self.book.observe_rules(family, rules.counters(rules.parse(text)))
        for family in self.families:
            for role in ipsets.COUNTED:
                name = ipsets.set_name(role, family)
                if name in snap.sets:
                    dump = snap.sets[name]
                    self.book.observe_set(name, role, dump.members if dump is not None else {})
        return snap

    def scrape(self) -> tuple[str, ...]:
        """The mangle saves and the counted sets in one pass, into the book; the errors of that pass."""
        return self._read([ipsets.set_name(role, f) for f in self.families for role in ipsets.COUNTED]).errors

    def drifted(self, synced: Mapping[int, set[ipsets.Member]]) -> bool:
        """Whether the sets or chains differ from what a sync for `synced` writes (two iptables-save processes)."""
        snap = self._read(ipsets.all_names(self.families))
        if snap.errors:
            return False
        if ipsets.plan(snap.sets, synced, self.networks, self.families).payload:
            return True
        return any(rules.plan(rules.parse(snap.saves[f]), f).payloads for f in self.families)

    def probe(self) -> str | None:
        """The fallback of `auto`: not probed."""
        return None

    def ready(self, auto: bool) -> str:
        """The iptables backend (detected as at start) and `ipset` answer."""
        try:
            mode = self.host.detect_mode()
            names = self.host.ipset_names()
        except CommandError as exc:
            raise NotReady(str(exc), "install iptables and ipset (or nftables) in the image and run with NET_ADMIN "
                                     "in the host network namespace") from exc
        return f"iptables layout: iptables {mode} backend, ipset answers ({len(names)} sets)"

    def present(self) -> bool:
        """Whether any of the layout's sets exist (its chains cannot exist without them)."""
        try:
            return any(self.host.dump_set(name) is not None for name in ipsets.all_names(FAMILIES))
        except OSError as exc:
            log.debug("netacct: cannot look for the iptables layout's sets: %s", exc)
            return False

    def final_read(self) -> OldRaw:
        """The counters on whichever backend holds the chains (auto detection might name the other one when the
        kubelet's hint is absent), and the sets, into the book; the raw values read."""
        old = OldRaw()
        for family in FAMILIES:
            raw: dict[str, Counts] = {}
            for mode in MODES:
                try:
                    found = rules.counters(rules.parse(self.host.save_full(mode, family, counters=True)))
                except CommandError as exc:
                    log.debug("netacct: no iptables-%s IPv%d counters to carry: %s", mode, family, exc)
                    continue
                for key, (packets, octets) in found.items():
                    before = raw.get(key, (0, 0))
                    raw[key] = (before[0] + packets, before[1] + octets)
            self.book.observe_rules(family, raw)
            old.rules[family] = raw
        for role in ipsets.COUNTED:
            for family in FAMILIES:
                name = ipsets.set_name(role, family)
                dump = self.host.dump_set(name)
                self.book.observe_set(name, role, dump.members if dump is not None else {})
                old.elements[(role, family)] = dict(dump.members) if dump is not None else {}
        return old

    def follow_installed(self) -> None:
        """Scrapes while a migration away from this layout waits read the backend that holds its chains."""
        if self.config.backend != "auto":
            return
        for mode in MODES:
            try:
                if rules.CHAIN_PREFIX in self.host.save_full(mode, 4, counters=False):
                    self._mode = mode
                    return
            except CommandError as exc:
                log.debug("netacct: no iptables-%s mangle table to look at: %s", mode, exc)

    # -- migration markers --------------------------------------------------------------------------------------

    def carried_rule_families(self, families: tuple[int, ...]) -> tuple[int, ...] | None:
        """IPv4 alone: ip6tables-nft drops restored IPv6 rule counters."""
        return (4,)

    def begin_carry(self) -> None:
        """The marker chain, before anything is preloaded."""
        self.host.restore(self.mode, 4, rules.marker_payload(create=True))

    def end_carry(self) -> None:
        """The old layout is gone: remove the marker chains."""
        chains = rules.MARKERS if self._carried else (rules.MARKER,)
        self.host.restore(self.mode, 4, rules.marker_payload(create=False, chains=chains))
        self._carried = False

    def _markers(self) -> set[str]:
        return set(rules.MARKERS) & set(rules.parse(self.host.save(self.mode, 4, counters=False)).chains)

    def holds_carry(self) -> bool:
        """The CARRIED marker is there: every object was created holding its carry and the kernel kept it, while
        the old layout may be half removed (the eBPF layout goes link by link: redoing from it would lose what the
        detached hooks no longer count)."""
        return rules.CARRIED in self._markers()

    def install_interrupted(self) -> bool:
        """The marker chain is there without CARRIED: a migration into this layout stopped before it was complete
        (the old layout is still whole: it is removed only after CARRIED)."""
        if self._markers() != {rules.MARKER}:
            return False
        log.warning("netacct: a migration to the iptables layout stopped before it was complete; installing it "
                    "again from the old layout's counts")
        return True

    # -- changing -----------------------------------------------------------------------------------------------

    def sync(self, desired: Desired) -> Members:
        """Sets first (one ipset restore), then each family's chains (one iptables-restore each); what differs
        from the last sync of this process is a repair, re-created holding the counts last read."""
        names = ipsets.all_names(self.families)
        snap = self._read(names)
        if snap.errors:
            raise SyncError("; ".join(snap.errors))
        bad = [name for name, dump in snap.sets.items() if dump is not None
               and not ipsets.compatible(name[len(ipsets.PREFIX):-1], int(name[-1]), dump)]
        if bad:
            log.warning("netacct: sets %s exist with another type; re-creating all of netacct's rules and sets", bad)
            self._remove_objects()
            self.book.kernel_state_lost()
            snap = self._read(names)
        # Our chains in the other backend (the hint chain moved) or in a family turned off would keep feeding the
        # shared sets, counting pod traffic twice or from stale members: remove them.
        other = [m for m in MODES if m != self.mode]
        for mode, family in [(m, f) for m in other for f in FAMILIES] + [
                (self.mode, f) for f in FAMILIES if f not in self.families]:
            self._remove_chains(mode, family)
        vanished_rules, vanished = self.book.take_vanished()
        carry = desired.carry
        repairing = desired.installed_here and carry is None and not bad
        synced = desired.synced
        members = sync_members(desired, self.book, lambda: {
            f: {m for role in ipsets.COUNTED if (d := snap.sets.get(ipsets.set_name(role, f))) for m in d.members}
            for f in self.families}, keep_synced=repairing)
        restore: dict[str, dict[ipsets.Member, Counts]] = {}
        if repairing:
            restore = repair.sets_to_restore(self.repairs, snap.sets, members, synced, families=self.families,
                                             vanished=vanished)
        plan = ipsets.plan(snap.sets, members, self.networks, self.families, carry.elements if carry else None,
                           restore=restore)
        self.host.ipset_restore(plan.payload)
        for name, elements in plan.carried.items():
            self.book.elements_created_with(name, elements)
        dropped: dict[str, Counts] = {}
        kept_all = True  # every carried rule counter was kept by the kernel
        for family in self.families:
            state = rules.parse(snap.saves[family])
            carried = carry.rules.get(family, {}) if carry else None
            if repairing:
                carried = repair.rule_values(self.repairs, state, family, vanished_rules)
            rule_plan = rules.plan(state, family, carried, migrating=carry is not None)
            for index, payload in enumerate(rule_plan.payloads):
                self.host.restore(self.mode, family, payload, counters=index == 0 and bool(rule_plan.carried))
                if index == 0 and rule_plan.reset_keys:
                    self.book.rules_restarted(family, rule_plan.reset_keys)
                    kept = self._check_carried(family, rule_plan.carried, quiet=repairing)
                    kept_all = kept_all and len(kept) == len(rule_plan.carried)
                    self.book.rules_created_with(family, kept)
                    if repairing:
                        dropped.update({k: v for k, v in rule_plan.carried.items() if k not in kept})
                    log.info("netacct: wrote %d IPv%d rules", len(rule_plan.reset_keys), family)
        if dropped and 4 in self.families:
            repair.move_into_ipv4(self.host, self.mode, self.book, dropped)
        if carry is not None and kept_all and rules.MARKER in rules.parse(snap.saves.get(4, "")).chains:
            # The kernel holds the whole carry: a migration cut short from here on is finished, not redone.
            self.host.restore(self.mode, 4, rules.marker_payload(create=True, chains=(rules.CARRIED,)))
            self._carried = True
        return {f: set(m) for f, m in members.items()}

    def _check_carried(self, family: int, carried: dict[str, Counts], quiet: bool = False) -> dict[str, Counts]:
        """The carried rule counters the kernel kept; one it dropped (an iptables build that ignores counters on
        restore) keeps its carry in the book only, with a warning, rather than being counted as lost."""
        if not carried:
            return carried
        kept = rules.counters(rules.parse(self.host.save(self.mode, family)))
        dropped = sorted(k for k, v in carried.items() if kept.get(k, (0, 0)) < v)
        if dropped and not quiet:
            log.warning("netacct: iptables-%s did not keep the carried IPv%d counters of %s; they are carried in "
                        "memory only", self.mode, family, dropped)
        return {k: v for k, v in carried.items() if k not in dropped}

    # -- removing -----------------------------------------------------------------------------------------------

    def remove(self) -> list[str]:
        """Every chain, jump rule and set of the layout (both backends, both families); the book forgets them."""
        removed = self._remove_objects()
        self.book.forget(FAMILIES, ipsets.all_names(FAMILIES))
        return removed

    def _remove_objects(self) -> list[str]:
        # A migration marker goes last: killed half-way through removing a half-installed layout (a migration being
        # redone), the sets left behind must still say "interrupted", or the next start would adopt them (their
        # preloaded counts beside the old layout's: counted twice).
        marked: list[str] = []
        removed = [item for mode in MODES for family in FAMILIES
                   for item in self._remove_chains(mode, family, keep=rules.MARKERS, kept=marked)]
        if self.host.has_ipset():
            names = self.host.ipset_names()
            self.host.ipset_restore(ipsets.destroy_payload(names))
            removed.extend(f"set {name}" for name in sorted(names) if ipsets.is_ours(name))
        for mode in marked:
            removed.extend(self._remove_chains(mode, 4))
        return removed

    def _remove_chains(self, mode: str, family: int, keep: Sequence[str] = (),
                       kept: list[str] | None = None) -> list[str]:
        """Remove netacct's chains (but `keep`; the mode goes to `kept` when one of them is there) and the jumps
        into them from one backend and family; what was removed."""
        try:
            state = rules.parse(self.host.save_full(mode, family))
        except CommandError as exc:  # that backend is not installed or not usable here
            log.debug("netacct: skipping iptables-%s IPv%d: %s", mode, family, exc)
            return []
        ours = state.ours() - set(keep)
        if kept is not None and set(keep) & state.ours() and mode not in kept:
            kept.append(mode)
        for payload in rules.removal_payloads(state, ours):
            self.host.restore(mode, family, payload)
        if ours:
            log.info("netacct: removed IPv%d chains %s from iptables-%s", family, sorted(ours), mode)
        return [f"{mode} IPv{family} chain {chain}" for chain in sorted(ours)]
