"""The native layout's side of the engine: reads that feed the counter book, one transaction per sync, removal.

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
from agent.netacct import ipsets, nft_layout
from agent.netacct.carry import Carry, OldRaw
from agent.netacct.counters import CounterBook, Counts, Source
from agent.netacct.nft_layout import NftPlan, NftState

log = logging.getLogger(__name__)


class NativeTable:
    """netacct's nftables table in `host`'s namespace, accounted into `book`."""

    def __init__(self, host: Host, book: CounterBook, families: Sequence[int],
                 networks: Sequence[nft_layout.Network]) -> None:
        self.host = host
        self.book = book
        self.families = tuple(families)
        self.networks = list(networks)

    @staticmethod
    def sources() -> list[Source]:
        """The book sources of this layout (both families, whatever the configuration says)."""
        return ["nft4", "nft6"]

    @staticmethod
    def set_names() -> list[str]:
        """The counted sets of this layout (both families)."""
        return [nft_layout.set_name(role, family) for family in (4, 6) for role in ipsets.COUNTED]

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

    def sync(self, state: NftState, members: Mapping[int, set[ipsets.Member]], carry: Carry | None = None, *,
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
