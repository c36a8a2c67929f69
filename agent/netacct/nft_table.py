"""The native nftables layout (`layout.Layout`): reads that feed the counter book, one transaction per sync, removal.

The engine holds its lock around every call. A read is five netlink dumps at most (named counters, then each
counted set's elements; a sync's read adds set definitions, chains with their rules' comments and the internal
sets). The named counters feed the book as sources `nft4` / `nft6` under the same keys the iptables layout uses,
the set elements under the nft set names, so the exported series are the same whichever layout counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from agent.host.netfilter import Host
from agent.host.nft_netlink import Elements
from agent.netacct import ipsets, nft_layout, nft_probe
from agent.netacct.carry import Carry, OldRaw, rule_keys
from agent.netacct.carry import plan as carry_plan
from agent.netacct.counters import CounterBook, Counts, Source
from agent.netacct.layout import Desired, Members, NotReady, sync_members
from agent.netacct.nft_layout import NftPlan, NftState
from agent.netacct.repair import Repairs, missing_elements

log = logging.getLogger(__name__)


class NftLayout:
    """netacct's nftables table in `host`'s namespace, accounted into `book`; repairs noted in `repairs`."""

    name = "nft"
    backend = "nftables"

    def __init__(self, host: Host, book: CounterBook, *, families: Sequence[int],
                 networks: Sequence[nft_layout.Network], repairs: Repairs) -> None:
        self.host = host
        self.book = book
        self.families = tuple(families)
        self.networks = list(networks)
        self.repairs = repairs

    @staticmethod
    def sources() -> list[Source]:
        """The book sources of this layout (both families, whatever the configuration says)."""
        return ["nft4", "nft6"]

    @staticmethod
    def set_names() -> list[str]:
        """The counted sets of this layout (both families)."""
        return [nft_layout.set_name(role, family) for family in (4, 6) for role in ipsets.COUNTED]

    def probe(self) -> str | None:
        """One packet through a counted set in a throw-away table (nft_probe)."""
        return nft_probe.probe(self.host)

    def ready(self, auto: bool) -> str:
        """`nft` answers and nf_tables can be read (read-only: `auto`'s probe packet is the agent's own step)."""
        why = self.host.nft_usable()
        if why is not None:
            raise NotReady(why, "install nftables in the image, or set netacct.layout: auto", fallback=True)
        try:
            present = self.host.nft_reader.sets() is not None
        except OSError as exc:
            raise NotReady(f"nf_tables cannot be read: {exc}",
                           "run with NET_ADMIN in the host network namespace") from exc
        table = f"table inet {nft_layout.TABLE} {'present' if present else 'not created yet'}"
        return f"native nftables layout: nft answers, {table}" + (
            "; auto confirms it with one probe packet at start" if auto else "")

    def present(self) -> bool:
        """Whether the table exists (False also where nf_tables cannot be asked)."""
        try:
            return self.host.nft_reader.sets() is not None
        except OSError as exc:
            log.debug("netacct: cannot look for the nftables table: %s", exc)
            return False

    def read(self, full: bool) -> NftState:
        """Read the counters (and, when `full`, the table's definitions) and fold them into the book."""
        reader = self.host.nft_reader
        state = NftState(sets=reader.sets() if full else {})
        if full and state.sets is None:
            return state
        state.counters = reader.counters()
        if full:
            state.chains = reader.chains()
        names = [nft_layout.set_name(role, f) for f in self.families for role in ipsets.ROLES
                 if full or role != ipsets.INTERNAL]
        for name in names:
            wanted = not full or name in (state.sets or {})
            state.elements[name] = reader.elements(name, ranges=name.startswith(ipsets.INTERNAL)) if wanted else None
        self._observe(state)
        return state

    def _observe(self, state: NftState) -> None:
        keys = nft_layout.counter_keys((4, 6))
        per_source: dict[Source, dict[str, Counts]] = {}
        for name, value in state.counters.items():
            if name in keys:
                family, key = keys[name]
                per_source.setdefault(f"nft{family}", {})[key] = value
        for source in self.sources():
            if source in per_source or int(str(source)[-1]) in self.families:
                self.book.observe_rules(source, per_source.get(source, {}))
        for family in self.families:
            for role in ipsets.COUNTED:
                name = nft_layout.set_name(role, family)
                found = state.elements.get(name)
                self.book.observe_set(name, role, _members(found))

    def scrape(self) -> tuple[str, ...]:
        """Read the counters into the book (errors raise: the engine reports them)."""
        self.read(full=False)
        return ()

    def drifted(self, synced: Mapping[int, set[ipsets.Member]]) -> bool:
        """Whether the table is gone or differs from what a sync for `synced` writes."""
        state = self.read(full=True)
        return not state.exists or bool(nft_layout.plan(state, synced, self.networks, self.families).payload)

    def final_read(self) -> OldRaw:
        """The counters into the book a last time (a migration away from this layout); the raw values read."""
        return self.raw(self.read(full=False))

    def carried_rule_families(self, families: tuple[int, ...]) -> tuple[int, ...] | None:
        """Named counters of both families take their carry."""
        return None

    def begin_carry(self) -> None:
        """Nothing: the marker counter is created in the same transaction as the preloaded table."""

    def end_carry(self) -> None:
        """The old layout is gone: drop the marker."""
        self.drop_marker()

    def holds_carry(self) -> bool:
        """The table exists with its marker counter: it was preloaded with the old layout's counts."""
        return self.present() and self.carried(self.read(full=True))

    def install_interrupted(self) -> bool:
        """Never: the table is created, preloaded, in one transaction."""
        return False

    def follow_installed(self) -> None:
        """Nothing to look for: the table has one place."""

    def sync(self, desired: Desired) -> Members:
        """One transaction bringing the table in line; what differs from the last sync of this process (someone
        else deleted the table, an element, or rewrote a chain) is repaired holding the counts last read."""
        state = self.read(full=True)
        _, vanished = self.book.take_vanished()
        carry = desired.carry
        repairing = desired.installed_here and carry is None
        synced = desired.synced
        members = sync_members(desired, self.book, lambda: self.members(state), keep_synced=repairing)
        restore: dict[str, dict[ipsets.Member, Counts]] = {}
        gone: list[str] = []
        tampered: list[str] = []
        if repairing and not state.exists:  # deleted: re-created holding the exported totals
            carry = carry_plan(self.book, OldRaw(), keys=rule_keys(), families=self.families, members=members,
                               owners=self.book.owners)
        elif repairing:
            for family in self.families:
                for role in ipsets.COUNTED:
                    name = nft_layout.set_name(role, family)
                    found = state.elements.get(name)
                    want = members.get(family, set()) & synced.get(family, set())
                    names, restore[name] = missing_elements(name, want, found.counted if found else (), vanished)
                    gone += names
            # Chains that differ from what the last sync wrote (the pods' addresses shape the rules: a chain
            # rewritten for a new pod is no repair).
            tampered = nft_layout.plan(state, synced, self.networks, self.families).rewritten_chains
        plan = self.apply(state, members, carry, marker=not repairing, restore=restore)
        if repairing and not state.exists:
            self.repairs.note("nft_table", [f"table inet {nft_layout.TABLE}"])
        elif repairing and plan.payload and not plan.rebuilt:
            self.repairs.note("nft_chain", tampered)
            self.repairs.note("nft_element", gone)
        return {f: set(m) for f, m in members.items()}

    def members(self, state: NftState) -> dict[int, set[ipsets.Member]]:
        """The pod addresses the counted sets hold now (used while the pod list is not known yet)."""
        out: dict[int, set[ipsets.Member]] = {}
        for family in self.families:
            out[family] = {m for role in ipsets.COUNTED
                           for m in _members(state.elements.get(nft_layout.set_name(role, family)))}
        return out

    def raw(self, state: NftState) -> OldRaw:
        """The raw values of a read (a migration's final read of this layout), by layout-neutral identity."""
        old = OldRaw()
        keys = nft_layout.counter_keys((4, 6))
        for name, value in state.counters.items():
            if name in keys:
                family, key = keys[name]
                old.rules.setdefault(family, {})[key] = value
        for family in (4, 6):
            for role in ipsets.COUNTED:
                found = _members(state.elements.get(nft_layout.set_name(role, family)))
                if found:
                    old.elements[(role, family)] = found
        return old

    @staticmethod
    def carried(state: NftState) -> bool:
        """Whether the table holds a migration's carry while the old layout may still exist (see CARRY_MARKER)."""
        return nft_layout.CARRY_MARKER in state.counters

    def drop_marker(self) -> None:
        """The old layout is gone: the carry marker has done its job."""
        self.host.nft_apply(f"delete counter inet {nft_layout.TABLE} {nft_layout.CARRY_MARKER}\n")

    def apply(self, state: NftState, members: Mapping[int, set[ipsets.Member]], carry: Carry | None = None, *,
             marker: bool = True, restore: Mapping[str, Mapping[ipsets.Member, Counts]] | None = None) -> NftPlan:
        """Apply the one transaction that brings the table in line (nothing when nothing differs); `carry`
        preloads a table this transaction creates (with the migration marker when `marker`), `restore` the elements
        it adds to existing sets, and the book is told so."""
        plan = nft_layout.plan(state, members, self.networks, self.families, carry, marker=marker, restore=restore)
        if not plan.payload:
            return plan
        self.host.nft_apply(plan.payload)
        for name, restored in (restore or {}).items():
            self.book.elements_created_with(name, restored)
        if carry is not None and not state.exists:
            for family, values in carry.rules.items():
                self.book.rules_created_with(f"nft{family}", values)
            for (role, family), elements in carry.elements.items():
                self.book.elements_created_with(nft_layout.set_name(role, family), elements)
        if plan.rebuilt:
            log.warning("netacct: the nftables table had an incompatible set or chain; re-created it")
            self.book.forget(self.sources(), self.set_names())
        elif plan.rewritten_chains:
            log.info("netacct: wrote nftables chains %s", plan.rewritten_chains)
        return plan

    def remove(self) -> list[str]:
        """Delete the table; what was removed."""
        if not self.present():
            return []
        self.host.nft_apply(nft_layout.removal_payload())
        self.book.forget(self.sources(), self.set_names())
        log.info("netacct: removed nftables table inet %s", nft_layout.TABLE)
        return [f"nftables table inet {nft_layout.TABLE}"]


def _members(found: Elements | None) -> dict[ipsets.Member, Counts]:
    if found is None:
        return {}
    return {(key, len(key) * 8): value for key, value in found.counted.items()}
