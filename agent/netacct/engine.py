"""The netacct engine: one lock around every read and change of the kernel state, and the counter book.

Why one lock: a change (rewritten chain, moved address) must be absorbed into the book before it happens and
marked right after, with no scrape in between, or a delta would be counted twice or to the wrong pod. So `sync`
reads (feeding the book), changes, and marks under the same lock that `scrape` takes for its single read pass.
Scrapes wait at most one sync (tens of milliseconds).

`sync` is idempotent: it only changes what differs from the desired state, so a restart adds no duplicates and
keeps the kernel's counters. `remove_all` removes exactly what netacct creates, in both layouts, on both iptables
backends and both families, whatever the current configuration says.

Two layouts count the same series: `nft` (one native table, nft_layout) and `iptables` (mangle chains and ipsets,
rules and ipsets). Migration: when the configured layout differs from the one found in the kernel (typically after
a restart with another `layout`), a sync with the pod list known reads the old layout a final time into the book,
installs the new one with its counters created holding the book's exported totals (carry: named counters and
elements for nft, elements and IPv4 rules for iptables), tells the book those are their last raw values, then
removes the old layout and forgets it. The totals neither jump at the migration nor drop at a later restart: the
kernel holds them. Packets the old layout counts between its final read and the new layout's commit are lost (one
`nft -f` transaction; for iptables an ipset restore and one iptables-restore per family); installing first would
count them twice, but then the read comes after the install and the install cannot hold it. An existing new
layout (adopted) keeps its own counts and the old one's final counts are carried in the book only. Markers make a
migration cut short safe: a preloaded nft table holds a marker counter until the iptables layout is gone (found
at a start with the iptables layout still there: remove it, its counts are in the table); the iptables layout has
a marker chain while it is being installed (found with the nft table still there: remove the iptables layout and
migrate again). Until the pod list is known the old layout keeps counting, scrapes read it, and nothing moves;
except that a preloaded table with its marker is finished at once (its counts already include the old layout's,
and scrapes of the old layout followed by the finish would count them twice).

Repairs (repair): what differs from the state this process installed was changed by someone else. A sync puts it
back holding the counts the book last read for the deleted objects (the book keeps the last raw values of rules
and elements that vanished), notes each repair, and the service checks for them every second between syncs.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from agent.config.netacct import NetacctConfig
from agent.netacct import ipsets, nft_layout, nft_probe, repair, rules
from agent.netacct.backend import FAMILIES, MODES, CommandError, Host, Snapshot
from agent.netacct.carry import Carry, OldRaw
from agent.netacct.carry import plan as carry_plan
from agent.netacct.counters import CounterBook, Counts, PodKey
from agent.netacct.nft_table import NativeTable
from agent.netacct.repair import Repairs, missing_elements
from agent.pods.model import Pod

log = logging.getLogger(__name__)


class SyncError(Exception):
    """A sync could not read or change the kernel state; the service logs it and retries."""


@dataclass(frozen=True)
class Reading:
    """What one scrape returns: accumulated totals, whether the read was complete, and how long it took."""

    rules: dict[str, Counts]
    pods: dict[PodKey, dict[str, Counts]]
    ok: bool
    seconds: float
    mode: str
    errors: tuple[str, ...] = ()
    layout: str = "iptables"


class Netacct:
    """Installs, reads and removes netacct's rules and sets through a `Host` port."""

    def __init__(self, config: NetacctConfig, host: Host | None = None) -> None:
        self.config = config
        self.host = host or Host(lock_wait=config.lock_wait_seconds)
        self.families = (4, 6) if config.ipv6 else (4,)
        self.book = CounterBook()
        self.syncs = 0
        self.sync_failures = 0
        self._lock = threading.Lock()
        self._mode: str | None = None if config.backend == "auto" else config.backend
        self._counting: str | None = None  # the layout that counts now (the old one while a migration waits)
        self._layout: str | None = None if config.layout == "auto" else config.layout
        self._networks = config.internal_networks()
        self._conflicts: set[str] = set()
        self.native = NativeTable(self.host, self.book, self.families, self._networks)
        self.repairs = Repairs()
        self._installed: str | None = None  # the layout this process has brought in line (repairs are against it)
        self._synced: dict[int, set[ipsets.Member]] = {}  # the pod addresses of that last sync

    @property
    def layout(self) -> str:
        """nft or iptables (probed on first use when configured as auto)."""
        if self._layout is None:
            why = nft_probe.probe(self.host)
            self._layout = "nft" if why is None else "iptables"
            if why is None:
                log.info("netacct: using the native nftables layout (table inet gpu_node_agent_netacct)")
            else:
                log.warning("netacct: the native nftables layout does not work here (%s); using the iptables "
                            "layout", why)
        return self._layout

    @property
    def mode(self) -> str:
        """The iptables backend in use (detected on first use when configured as auto)."""
        if self._mode is None:
            self._mode = self.host.detect_mode(self.families)
            log.info("netacct: using the iptables-%s backend", self._mode)
        return self._mode

    def close(self) -> None:
        """Release the netlink socket (rules and sets stay)."""
        self.host.close()

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

    def scrape(self) -> Reading:
        """One read pass over every counter, folded into the book; never raises for kernel errors."""
        started = time.perf_counter()
        with self._lock:
            errors: tuple[str, ...] = ()
            # While a migration waits for the pod list, the old layout still counts: read it, or the exported
            # totals of a restarted agent would sit at zero and then jump (Prometheus would count the jump again).
            counting = self._counting or self._layout
            try:
                if counting == "nft":
                    self.native.read(full=False)
                elif counting == "iptables":
                    names = [ipsets.set_name(role, f) for f in self.families for role in ipsets.COUNTED]
                    errors = self._read(names).errors
                else:
                    errors = ("no sync has run yet",)
            except (CommandError, OSError) as exc:
                errors = (str(exc),)
            mode = "nftables" if counting == "nft" else self._mode or "unknown"
            return Reading(self.book.rule_totals(), self.book.pod_totals(), not errors,
                           time.perf_counter() - started, mode, errors, counting or "unknown")

    def needs_repair(self) -> bool:
        """Whether the state this process installed differs now (someone else changed it): a read-only check the
        service runs between syncs, so that a repair comes within seconds rather than a sync interval. Costs one
        scrape's read (netlink; two iptables-save processes on the iptables layout)."""
        with self._lock:
            layout = self._installed
            if layout is None or (self._counting or layout) != layout:
                return False
            try:
                if layout == "nft":
                    state = self.native.read(full=True)
                    return not state.exists or bool(
                        nft_layout.plan(state, self._synced, self._networks, self.families).payload)
                snap = self._read(ipsets.all_names(self.families))
                if snap.errors:
                    return False
                if ipsets.plan(snap.sets, self._synced, self._networks, self.families).payload:
                    return True
                return any(rules.plan(rules.parse(snap.saves[f]), f).payloads for f in self.families)
            except (CommandError, OSError) as exc:
                log.debug("netacct: repair check failed (the next sync reports it): %s", exc)
                return False

    # -- changing -----------------------------------------------------------------------------------------------

    def _pod_members(self, pods: Sequence[Pod]) -> tuple[dict[bytes, PodKey], dict[int, set[ipsets.Member]]]:
        owners: dict[bytes, PodKey] = {}
        members: dict[int, set[ipsets.Member]] = {f: set() for f in FAMILIES}
        conflicts: set[str] = set()
        for pod in pods:
            for ip in pod.ips:
                try:  # make_pod validates; a Pod built some other way is checked again before any payload
                    packed = ipaddress.ip_address(ip).packed
                except ValueError:
                    log.warning("netacct: skipping address %r of pod %s/%s: not an IP address", ip, pod.namespace,
                                pod.name)
                    continue
                owner = owners.setdefault(packed, (pod.namespace, pod.name))
                if owner != (pod.namespace, pod.name):
                    conflicts.add(ip)
                    continue
                members[4 if len(packed) == 4 else 6].add((packed, len(packed) * 8))
        for ip in sorted(conflicts - self._conflicts):
            log.warning("netacct: %s is listed for more than one pod; counting it for the first", ip)
        self._conflicts = conflicts
        return owners, members

    def sync(self, pods: Sequence[Pod] | None) -> None:
        """Bring sets and rules in line with the config and `pods` (None: pods unknown yet, keep members)."""
        with self._lock:
            try:
                self._sync(pods)
                self.syncs += 1
            except SyncError:
                self.sync_failures += 1
                raise
            except (CommandError, OSError) as exc:
                self.sync_failures += 1
                raise SyncError(str(exc)) from exc

    def _sync(self, pods: Sequence[Pod] | None) -> None:
        layout = self.layout
        old = "iptables" if layout == "nft" else "nft"
        self._counting = layout
        if not self._present(old):
            self._sync_layout(layout, pods)
            self._installed = layout
        elif layout == "nft" and self._present(layout) and self.native.carried(self.native.read(full=True)):
            # The table already holds the old layout's counts: finish now, pod list or not. Waiting would have
            # scrapes read the old layout and the finish then add the table's copy of the same counts.
            self._finish_to_nft(pods)
        elif pods is None:
            log.info("netacct: the %s layout is still installed; migrating once the pod list is known", old)
            self._counting = old
            if old == "iptables" and self.config.backend == "auto":
                self._mode = self._backend_holding_chains() or self._mode
            return
        elif not self._present(layout):
            self._migrate(layout, pods)
        else:
            self._resume(layout, pods)

    def _backend_holding_chains(self) -> str | None:
        """The iptables backend whose mangle table holds the old layout's chains (the kubelet's hint may have
        moved since they were written), so that scrapes while a migration waits read its rule counters."""
        for mode in MODES:
            try:
                if rules.CHAIN_PREFIX in self.host.save_full(mode, 4, counters=False):
                    return mode
            except CommandError as exc:
                log.debug("netacct: no iptables-%s mangle table to look at: %s", mode, exc)
        return None

    def _present(self, layout: str) -> bool:
        return self.native.present() if layout == "nft" else self._iptables_present()

    def _sync_layout(self, layout: str, pods: Sequence[Pod] | None, carry: Carry | None = None) -> None:
        if layout == "nft":
            self._sync_native(pods, carry)
        else:
            self._sync_iptables(pods, carry)

    def _iptables_present(self) -> bool:
        """Whether any of the iptables layout's sets exist (its chains cannot exist without them)."""
        try:
            return any(self.host.dump_set(name) is not None for name in ipsets.all_names(FAMILIES))
        except OSError as exc:
            log.debug("netacct: cannot look for the iptables layout's sets: %s", exc)
            return False

    def _migrate(self, new: str, pods: Sequence[Pod]) -> None:
        """Carry the old layout's counts into the new one's kernel counters: final read of the old layout (into the
        book), install the new one holding the book's totals (carry), remove the old one."""
        owners, members = self._pod_members(pods)
        self.book.set_pods(owners)
        if new == "nft":
            old = self._final_iptables_read()
        else:
            old = self.native.raw(self.native.read(full=False))
            self.host.restore(self.mode, 4, rules.marker_payload(create=True))  # before anything is preloaded
        keys = [key for _, key in nft_layout.counter_keys((4,)).values()]
        # ip6tables-nft 1.8.9 drops the counters of IPv6 rule lines (`[p:b] -A` with --counters, and `-c`), while
        # IPv4 and legacy keep them: the iptables layout carries each node total in its IPv4 rule alone.
        carry = carry_plan(self.book, old, keys=keys, families=self.families, members=members, owners=owners,
                           rule_families=(4,) if new == "iptables" else None)
        self._sync_layout(new, pods, carry)
        if new == "nft":
            self._remove_iptables_layout()
            self.native.drop_marker()
        else:
            self.native.remove()
            self.host.restore(self.mode, 4, rules.marker_payload(create=False))
        self._installed = new
        log.info("netacct: migrated from the %s layout; its counts carry into the new layout's counters",
                 "iptables" if new == "nft" else "nft")

    def _resume(self, new: str, pods: Sequence[Pod]) -> None:
        """Both layouts exist: a migration stopped half-way (the agent died), or the new layout was installed by
        someone else. The carry markers say which."""
        if new == "nft":
            if self.native.carried(self.native.read(full=True)):
                self._finish_to_nft(pods)
                return
        elif rules.MARKER in rules.parse(self.host.save(self.mode, 4, counters=False)).chains:
            log.warning("netacct: a migration to the iptables layout stopped before it was complete; installing "
                        "it again from the nft layout's counts")
            self._remove_locked(MODES, native=False)
            self.book.forget(FAMILIES, ipsets.all_names(FAMILIES))
            self._migrate(new, pods)
            return
        self._sync_layout(new, pods)
        self._installed = new
        self._migrate_in_memory("iptables" if new == "nft" else "nft")

    def _finish_to_nft(self, pods: Sequence[Pod] | None) -> None:
        """A migration to the nft layout stopped after installing the preloaded table (its marker is there): the
        iptables layout's counts are in the table, so remove the iptables layout and count the table alone."""
        log.warning("netacct: a migration to the nft layout stopped before removing the iptables layout; its counts "
                    "are in the table already, removing it")
        self._remove_iptables_layout()
        self._sync_native(pods)  # drops the marker with the other stale objects
        self._installed = "nft"

    def _migrate_in_memory(self, old: str) -> None:
        """An adopted layout keeps its own counts: the old one's final counts go to the book only (they are lost
        from the exported totals at the next restart), then it is removed."""
        if old == "nft":
            self.native.read(full=False)
            self.native.remove()
        else:
            self._final_iptables_read()
            self._remove_iptables_layout()
        log.warning("netacct: migrated from the %s layout into an existing one; its final counts are carried in "
                    "memory only", old)

    def _remove_iptables_layout(self) -> None:
        self._remove_locked(MODES, native=False)
        self.book.forget(FAMILIES, ipsets.all_names(FAMILIES))

    def _final_iptables_read(self) -> OldRaw:
        """The iptables layout's counters on whichever backend holds its chains (auto detection might name the
        other one when the kubelet's hint is absent), and its sets, into the book; the raw values read."""
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

    def _sync_native(self, pods: Sequence[Pod] | None, carry: Carry | None = None) -> None:
        state = self.native.read(full=True)
        _, vanished = self.book.take_vanished()
        repairing = self._installed == "nft" and carry is None
        if pods is not None:
            owners, members = self._pod_members(pods)
            self.book.set_pods(owners)
        elif repairing:
            members = self._synced  # what the table held: a deleted element is not forgotten
        else:
            members = self.native.members(state)
        restore: dict[str, dict[ipsets.Member, Counts]] = {}
        gone: list[str] = []
        tampered: list[str] = []
        if repairing and not state.exists:  # deleted: re-created holding the exported totals
            keys = [key for _, key in nft_layout.counter_keys((4,)).values()]
            carry = carry_plan(self.book, OldRaw(), keys=keys, families=self.families, members=members,
                               owners=self.book.owners)
        elif repairing:
            for family in self.families:
                for role in ipsets.COUNTED:
                    name = nft_layout.set_name(role, family)
                    found = state.elements.get(name)
                    want = members.get(family, set()) & self._synced.get(family, set())
                    names, restore[name] = missing_elements(name, want, found.counted if found else (), vanished)
                    gone += names
            # Chains that differ from what the last sync wrote (the pods' addresses shape the rules: a chain
            # rewritten for a new pod is no repair).
            tampered = nft_layout.plan(state, self._synced, self._networks, self.families).rewritten_chains
        plan = self.native.sync(state, members, carry, marker=not repairing, restore=restore)
        self._synced = {f: set(m) for f, m in members.items()}
        if repairing and not state.exists:
            self.repairs.note("nft_table", [f"table inet {nft_layout.TABLE}"])
        elif repairing and plan.payload and not plan.rebuilt:
            self.repairs.note("nft_chain", tampered)
            self.repairs.note("nft_element", gone)

    def _sync_iptables(self, pods: Sequence[Pod] | None, carry: Carry | None = None) -> None:
        names = ipsets.all_names(self.families)
        snap = self._read(names)
        if snap.errors:
            raise SyncError("; ".join(snap.errors))
        bad = [name for name, dump in snap.sets.items() if dump is not None
               and not ipsets.compatible(name[len(ipsets.PREFIX):-1], int(name[-1]), dump)]
        if bad:
            log.warning("netacct: sets %s exist with another type; re-creating all of netacct's rules and sets", bad)
            self._remove_locked(MODES, native=False)
            self.book.kernel_state_lost()
            snap = self._read(names)
        # Our chains in the other backend (the hint chain moved) or in a family turned off would keep feeding the
        # shared sets, counting pod traffic twice or from stale members: remove them.
        other = [m for m in MODES if m != self.mode]
        for mode, family in [(m, f) for m in other for f in FAMILIES] + [
                (self.mode, f) for f in FAMILIES if f not in self.families]:
            self._remove_chains(mode, family)
        vanished_rules, vanished = self.book.take_vanished()
        repairing = self._installed == "iptables" and carry is None and not bad
        if pods is not None:
            owners, members = self._pod_members(pods)
            self.book.set_pods(owners)
        elif repairing:
            members = self._synced  # what the sets held: a deleted element is not forgotten
        else:
            members = {f: {m for role in ipsets.COUNTED if (d := snap.sets.get(ipsets.set_name(role, f)))
                           for m in d.members} for f in self.families}
        restore: dict[str, dict[ipsets.Member, Counts]] = {}
        if repairing:
            restore = repair.sets_to_restore(self.repairs, snap.sets, members, self._synced,
                                              families=self.families,
                                              vanished=vanished)
        plan = ipsets.plan(snap.sets, members, self._networks, self.families, carry.elements if carry else None,
                           restore=restore)
        self.host.ipset_restore(plan.payload)
        for name, elements in plan.carried.items():
            self.book.elements_created_with(name, elements)
        self._synced = {f: set(m) for f, m in members.items()}
        dropped: dict[str, Counts] = {}
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
                    self.book.rules_created_with(family, kept)
                    if repairing:
                        dropped.update({k: v for k, v in rule_plan.carried.items() if k not in kept})
                    log.info("netacct: wrote %d IPv%d rules", len(rule_plan.reset_keys), family)
        if dropped and 4 in self.families:
            repair.move_into_ipv4(self.host, self.mode, self.book, dropped)

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

    def remove_all(self) -> list[str]:
        """Remove everything netacct made: the nftables table, and every chain, jump rule and set of the iptables
        layout (both backends, both families); what was removed."""
        with self._lock:
            self._installed = None
            return self._remove_locked(MODES)

    def _remove_chains(self, mode: str, family: int) -> list[str]:
        """Remove netacct's chains and the jumps into them from one backend and family; what was removed."""
        try:
            state = rules.parse(self.host.save_full(mode, family))
        except CommandError as exc:  # that backend is not installed or not usable here
            log.debug("netacct: skipping iptables-%s IPv%d: %s", mode, family, exc)
            return []
        ours = state.ours()
        for payload in rules.removal_payloads(state, ours):
            self.host.restore(mode, family, payload)
        if ours:
            log.info("netacct: removed IPv%d chains %s from iptables-%s", family, sorted(ours), mode)
        return [f"{mode} IPv{family} chain {chain}" for chain in sorted(ours)]

    def _remove_locked(self, modes: Sequence[str], native: bool = True) -> list[str]:
        removed = self.native.remove() if native else []
        removed += [item for mode in modes for family in FAMILIES for item in self._remove_chains(mode, family)]
        if not self.host.has_ipset():
            return removed
        names = self.host.ipset_names()
        self.host.ipset_restore(ipsets.destroy_payload(names))
        removed.extend(f"set {name}" for name in sorted(names) if ipsets.is_ours(name))
        return removed
