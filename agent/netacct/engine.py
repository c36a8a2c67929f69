"""The netacct engine: one lock around every read and change of the kernel state, and the counter book.

Why one lock: a change (rewritten chain, moved address) must be absorbed into the book before it happens and
marked right after, with no scrape in between, or a delta would be counted twice or to the wrong pod. So `sync`
reads (feeding the book), changes, and marks under the same lock that `scrape` takes for its single read pass.
Scrapes wait at most one sync (tens of milliseconds).

`sync` is idempotent: it only changes what differs from the desired state, so a restart adds no duplicates and
keeps the kernel's counters. `remove_all` removes exactly what netacct creates, in both layouts, on both iptables
backends and both families, whatever the current configuration says.

Three layouts count the same series, each an implementation of `layout.Layout`, chosen once (`layout.choose`):
`ebpf` (tc programs and pinned maps, ebpf_table), `nft` (one native table, nft_table) and `iptables` (mangle
chains and ipsets, iptables_table); the engine never asks which one it holds.

Migration: when the configured layout differs from the one found in the kernel (typically after a restart
with another `layout`), a sync with the pod list known reads the old layout a final time into the book,
installs the new one with its counters created holding the book's exported totals (carry: named counters and
elements for nft, elements and IPv4 rules for iptables), tells the book those are their last raw values, then
removes the old layout and forgets it. The totals neither jump at the migration nor drop at a later restart: the
kernel holds them. Packets the old layout counts between its final read and the new layout's commit are lost (one
`nft -f` transaction; for iptables an ipset restore and one iptables-restore per family); installing first would
count them twice, but then the read comes after the install and the install cannot hold it. An existing new
layout (adopted) keeps its own counts and the old one's final counts are carried in the book only. Markers make a
migration cut short safe: a preloaded nft table holds a marker counter until the iptables layout is gone (found
at a start with the iptables layout still there: remove it, its counts are in the table); the iptables layout has
a marker chain while it is being installed (found alone with the old layout still there: remove the iptables layout
and migrate again) and a second one once it holds the whole carry (then finish: the old layout may be half
removed, as the eBPF layout goes link by link, and a redo would lose what its detached hooks did not count); the
eBPF layout has the same two marker pins. Until the pod list is known the old layout keeps counting, scrapes read
it, and nothing moves; except that a new layout that holds the carry is finished at once (its counts already
include the old layout's, and scrapes of the old layout followed by the finish would count them twice). Every kill
point of every migration between two layouts is tested (test_e2e_kill_points, test_e2e_ebpf_kill_points).

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
from agent.host.netfilter import FAMILIES, CommandError, Host
from agent.netacct import ipsets
from agent.netacct.carry import plan as carry_plan
from agent.netacct.carry import rule_keys
from agent.netacct.counters import CounterBook, Counts, PodKey
from agent.netacct.ebpf_table import EbpfLayout
from agent.netacct.iptables_table import IptablesLayout
from agent.netacct.layout import Desired, Layout, PodMembers, SyncError, choose, readiness
from agent.netacct.nft_table import NftLayout
from agent.netacct.repair import Repairs
from agent.pods.model import Pod

__all__ = ["Netacct", "Reading", "SyncError"]

log = logging.getLogger(__name__)


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
    """Installs, reads and removes netacct's counting objects through a `Host` port, in one of its layouts."""

    def __init__(self, config: NetacctConfig, host: Host | None = None) -> None:
        self.config = config
        self.host = host or Host(lock_wait=config.lock_wait_seconds)
        self.families = (4, 6) if config.ipv6 else (4,)
        self.book = CounterBook()
        self.syncs = 0
        self.sync_failures = 0
        self._lock = threading.Lock()
        networks = config.internal_networks()
        self.repairs = Repairs()
        self.nft = NftLayout(self.host, self.book, families=self.families, networks=networks, repairs=self.repairs)
        self.iptables = IptablesLayout(config, self.host, self.book, families=self.families, networks=networks,
                                       repairs=self.repairs)
        self.ebpf = EbpfLayout(self.host, self.book, families=self.families, networks=networks, repairs=self.repairs,
                               bpffs_dir=config.bpffs_dir)
        # auto's preference, and removal order
        self._layouts: tuple[Layout, ...] = (self.ebpf, self.nft, self.iptables)
        self._chosen: Layout | None = None if config.layout == "auto" else choose(config.layout, self._layouts)
        self._counting: Layout | None = None  # the layout that counts now (the old one while a migration waits)
        self._conflicts: set[str] = set()
        self._installed: Layout | None = None  # the layout this process has brought in line (repairs are against it)
        self._synced: dict[int, set[ipsets.Member]] = {}  # the pod addresses of that last sync

    @property
    def chosen(self) -> Layout:
        """The layout to count with (probed on first use when configured as auto)."""
        if self._chosen is None:
            self._chosen = choose(self.config.layout, self._layouts)
        return self._chosen

    @property
    def layout(self) -> str:
        """ebpf, nft or iptables: the chosen layout's name."""
        return self.chosen.name

    @property
    def mode(self) -> str:
        """The iptables backend in use (detected on first use when configured as auto)."""
        return self.iptables.mode

    def readiness(self) -> str:
        """Read-only, for the doctor: the layout this configuration would count with and what answers for it;
        layout.NotReady when it cannot count here."""
        with self._lock:
            return readiness(self.config.layout, self._layouts)

    def close(self) -> None:
        """Release the netlink socket and the eBPF layout's fds (rules, sets and pinned objects stay, as on process
        exit; a later call opens them again)."""
        with self._lock:
            self.ebpf.close()
            self.host.close()

    # -- reading ------------------------------------------------------------------------------------------------

    def scrape(self) -> Reading:
        """One read pass over every counter, folded into the book; never raises for kernel errors."""
        started = time.perf_counter()
        with self._lock:
            errors: tuple[str, ...] = ()
            # While a migration waits for the pod list, the old layout still counts: read it, or the exported
            # totals of a restarted agent would sit at zero and then jump (Prometheus would count the jump again).
            counting = self._counting or self._chosen
            try:
                errors = counting.scrape() if counting is not None else ("no sync has run yet",)
            except (CommandError, OSError) as exc:
                errors = (str(exc),)
            mode = (counting or self.iptables).backend
            return Reading(self.book.rule_totals(), self.book.pod_totals(), not errors,
                           time.perf_counter() - started, mode, errors, counting.name if counting else "unknown")

    def needs_repair(self) -> bool:
        """Whether the state this process installed differs now (someone else changed it): a read-only check the
        service runs between syncs, so that a repair comes within seconds rather than a sync interval. Costs one
        scrape's read (netlink; two iptables-save processes on the iptables layout)."""
        with self._lock:
            layout = self._installed
            if layout is None or (self._counting or layout) is not layout:
                return False
            try:
                return layout.drifted(self._synced)
            except (CommandError, OSError) as exc:
                log.debug("netacct: repair check failed (the next sync reports it): %s", exc)
                return False

    # -- changing -----------------------------------------------------------------------------------------------

    def _pod_members(self, pods: Sequence[Pod]) -> PodMembers:
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
        return PodMembers(owners, members)

    def sync(self, pods: Sequence[Pod] | None) -> None:
        """Bring the layout in line with the config and `pods` (None: pods unknown yet, keep members)."""
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
        new = self.chosen
        self._counting = new
        old = next((layout for layout in self._layouts if layout is not new and layout.present()), None)
        if old is None:
            self._bring_in_line(new, pods)
        elif new.holds_carry():
            # The new layout already holds the old one's counts: finish now, pod list or not. Waiting would have
            # scrapes read the old layout and the finish then add the new one's copy of the same counts.
            self._finish(old, new, pods)
        elif pods is None:
            log.info("netacct: the %s layout is still installed; migrating once the pod list is known", old.name)
            self._counting = old
            old.follow_installed()
        elif not new.present():
            self._migrate(old, new, pods)
        else:
            self._resume(old, new, pods)

    def _bring_in_line(self, layout: Layout, pods: Sequence[Pod] | None) -> None:
        """A plain sync of the installed layout (repairs counted when this process installed it before)."""
        members = self._pod_members(pods) if pods is not None else None
        self._synced = layout.sync(Desired(members, self._synced, installed_here=self._installed is layout))
        self._installed = layout

    def _migrate(self, old: Layout, new: Layout, pods: Sequence[Pod]) -> None:
        """Carry the old layout's counts into the new one's kernel counters: final read of the old layout (into the
        book), install the new one holding the book's totals (carry), remove the old one."""
        members = self._pod_members(pods)
        self.book.set_pods(members.owners)
        raw = old.final_read()
        new.begin_carry()
        carry = carry_plan(self.book, raw, keys=rule_keys(), families=self.families, members=members.members,
                           owners=members.owners, rule_families=new.carried_rule_families(self.families))
        self._synced = new.sync(Desired(members, self._synced, installed_here=self._installed is new, carry=carry))
        old.remove()
        new.end_carry()
        self._installed = new
        log.info("netacct: migrated from the %s layout; its counts carry into the new layout's counters", old.name)

    def _resume(self, old: Layout, new: Layout, pods: Sequence[Pod]) -> None:
        """Both layouts exist: a migration stopped half-way (the agent died), or the new layout was installed by
        someone else. The carry markers say which."""
        if new.holds_carry():
            self._finish(old, new, pods)
            return
        if new.install_interrupted():
            new.remove()
            self._migrate(old, new, pods)
            return
        self._bring_in_line(new, pods)
        # An adopted layout keeps its own counts: the old one's final counts go to the book only (they are lost
        # from the exported totals at the next restart), then it is removed.
        old.final_read()
        old.remove()
        log.warning("netacct: migrated from the %s layout into an existing one; its final counts are carried in "
                    "memory only", old.name)

    def _finish(self, old: Layout, new: Layout, pods: Sequence[Pod] | None) -> None:
        """A migration stopped after installing the preloaded new layout (its marker is there): the old layout's
        counts are in it, so remove the old layout and count the new one alone."""
        log.warning("netacct: a migration to the %s layout stopped before removing the %s layout; its counts are "
                    "in the new layout already, removing it", new.name, old.name)
        old.remove()
        self._bring_in_line(new, pods)  # drops the marker with the other stale objects

    # -- removing -----------------------------------------------------------------------------------------------

    def remove_all(self) -> list[str]:
        """Remove everything netacct made, in every layout (the nftables table; every chain, jump rule and set of
        the iptables layout on both backends and both families); what was removed."""
        with self._lock:
            self._installed = None
            return [item for layout in self._layouts for item in layout.remove()]
