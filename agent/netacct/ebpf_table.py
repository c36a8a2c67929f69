"""The eBPF layout (`layout.Layout`): the agent's own tc programs count into pinned per-CPU maps.

Why: every netfilter design pays a set lookup per forwarded packet in the forwarding path; a tcx program with the
internal CIDRs compared inline and one pod lookup per forwarded packet (two inlined array lookups where the pods'
addresses fit one /16 or /112, else a hash lookup) costs a fraction of that (README, Performance).
The objects are built and loaded at run time by the agent (agent.netacct.ebpf: assembler, program builder,
objects), through the bpf(2) port agent.host.bpf; nothing is compiled or installed on the node.

The maps feed the book as sources `ebpf4` / `ebpf6` under the same rule keys as the other layouts, and per pod
address and role under `ebpf_<role><family>`, so the exported series are the same whichever layout counts them.
Pins keep maps and links alive while the agent is down, so a restart reads on from the kernel's values. A
migration into this layout creates the maps holding the carry; two marker pins (`carrying` before anything is
preloaded, `carried` once everything is) say how far an interrupted migration got.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
from collections.abc import Mapping, Sequence

from agent.host import bpf, bpf_tc
from agent.host.netfilter import Host
from agent.host.netns import entered
from agent.netacct import ipsets
from agent.netacct.carry import OldRaw
from agent.netacct.counters import CounterBook, Counts, Source
from agent.netacct.ebpf import program
from agent.netacct.ebpf.objects import SHAPES, Objects, PodEntry, Read
from agent.netacct.layout import Desired, Members, NotReady, sync_members
from agent.netacct.repair import Repairs, missing_elements

log = logging.getLogger(__name__)

CARRYING, CARRIED = "carrying", "carried"


def set_name(role: str, family: int) -> str:
    """The book's name for one role and family of the pods map, e.g. ebpf_rx_inet4."""
    return f"ebpf_{role.replace('-', '_')}{family}"


class EbpfLayout:
    """netacct's eBPF objects under `bpffs_dir`, hooked to every interface of `host`'s namespace."""

    name = "ebpf"

    def __init__(self, host: Host, book: CounterBook, *, families: Sequence[int],
                 networks: Sequence[program.Network], repairs: Repairs, bpffs_dir: str) -> None:
        self.host = host
        self.book = book
        self.families = tuple(families)
        self.networks = list(networks)
        self.repairs = repairs
        self.objects = Objects(bpffs_dir, netns=host.netns)

    @property
    def backend(self) -> str:
        """How the programs are attached: tcx, clsact (cls_bpf), or ebpf before the first attach."""
        return {True: "tcx", False: "clsact"}.get(self.objects.tcx, "ebpf")  # type: ignore[arg-type]

    @staticmethod
    def sources() -> list[Source]:
        """The book sources of this layout (both families)."""
        return ["ebpf4", "ebpf6"]

    @staticmethod
    def set_names() -> list[str]:
        """The book's set names of this layout (both families)."""
        return [set_name(role, family) for family in (4, 6) for role in ipsets.COUNTED]

    # -- choosing -----------------------------------------------------------------------------------------------

    def probe(self) -> str | None:
        """For `auto`: bpffs at the pin directory, the programs (hash and index modes) loaded and one attached for
        real (the attachment is removed at once: an unpinned tcx link detaches when its fd closes). None, or why
        not (a refused program with the verifier's last lines)."""
        if (why := self.host.bpf_usable()) is not None:
            return why
        probe = Objects(self.objects.bpffs_dir, netns=self.host.netns, tcx=self.objects.tcx)
        try:
            bpf.mount_bpffs(self.objects.bpffs_dir)
            for name, (kind, key_size, value_size, entries, flags) in SHAPES.items():  # the layout's shapes
                probe.maps[name] = bpf.map_create(kind, key_size, value_size, 8 if name == "pods" else entries,
                                                  name="gna_probe", flags=flags)
            specs = probe.specs(self.families, self.networks)
            ifaces = bpf_tc.interfaces(self.host.netns)
            for spec in specs.values():
                probe.load(spec, clsact=False)
            pods = [ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fd00::1")]  # the index mode's program
            probe.load(program.spec(program.EGRESS, 14, self.families, self.networks, pods=pods,
                                    index={family: 0 for family in self.families}), clsact=False)
            if ifaces:
                self.objects.tcx = probe.attach_test(ifaces[0], specs[(program.INGRESS, ifaces[0].l2_len)])
        except bpf.VerifierError as exc:
            return f"the kernel refused the program: {exc}: {exc.tail()}"
        except OSError as exc:
            return str(exc)
        finally:
            probe.close()
        return None

    def ready(self, auto: bool) -> str:
        """Read-only, for the doctor: bpf(2) answers here and where the pins live."""
        if (why := self.host.bpf_usable()) is not None:
            raise NotReady(why, "set netacct.layout: nft or iptables", fallback=True)
        try:
            fd = bpf.map_create(bpf.MAP_ARRAY, 4, 8, 1, name="gna_ready")
        except OSError as exc:
            raise NotReady(f"bpf(2) refuses to create a map: {exc}",
                           "give the agent CAP_BPF and CAP_NET_ADMIN (or set netacct.layout: nft)",
                           fallback=True) from exc
        os.close(fd)
        where = self.objects.bpffs_dir
        pins = "pinned objects present" if self.objects.present() else "nothing pinned yet"
        mounted = "bpffs mounted" if bpf.is_bpffs(where) else "bpffs to be mounted at start"
        return f"eBPF layout: bpf(2) answers, {mounted} at {where}, {pins}" + (
            "; auto confirms it by loading and attaching at start" if auto else "")

    # -- reading ------------------------------------------------------------------------------------------------

    def present(self) -> bool:
        """Whether any pinned map or link of this layout exists."""
        return self.host.bpf_usable() is None and self.objects.present()

    def _read(self) -> Read | None:
        if not self.objects.maps and not self.objects.open_maps(create=False):
            return None
        read = self.objects.read(self.families)
        for family in self.families:
            self.book.observe_rules(f"ebpf{family}", read.node.get(family, {}))
        grouped = _grouped(read)
        for family in self.families:
            for role in ipsets.COUNTED:
                self.book.observe_set(set_name(role, family), role, grouped.get((role, family), {}))
        return read

    def scrape(self) -> tuple[str, ...]:
        """Read both maps into the book (one batch lookup each)."""
        if self._read() is None:
            return ("the eBPF layout's pinned maps are missing",)
        return ()

    def drifted(self, synced: Mapping[int, set[ipsets.Member]]) -> bool:
        """Whether a map's pin is gone, a link of ours was detached or unpinned, or the pod entries or index entries
        differ from what a sync for `synced` wrote (someone else changed them)."""
        if not self.objects.maps and not self.objects.open_maps(create=False):
            return True
        if self.objects.unpinned_maps():
            return True
        with entered(self.host.netns):
            if self.objects.broken_links():
                return True
        return set(self.objects.pod_keys()) != _keys(synced) or self.objects.index_drifted()

    def final_read(self) -> OldRaw:
        """The maps into the book a last time; the raw values read."""
        read = self._read()
        old = OldRaw()
        if read is None:
            return old
        old.rules = {family: dict(keys) for family, keys in read.node.items()
                     if any(v != (0, 0) for v in keys.values())}
        old.elements = _grouped(read)
        return old

    # -- migrations ---------------------------------------------------------------------------------------------

    def carried_rule_families(self, families: tuple[int, ...]) -> tuple[int, ...] | None:
        """Both families' node slots take their carry."""
        return None

    def _marker(self, name: str, create: bool) -> bool:
        path = self.objects.path(name)
        if not create:
            return os.path.exists(path)
        bpf.mount_bpffs(self.objects.bpffs_dir)
        fd = bpf.map_create(bpf.MAP_ARRAY, 4, 8, 1, name=f"gna_{name}")
        try:
            bpf.obj_pin(fd, path)
        finally:
            os.close(fd)
        return True

    def begin_carry(self) -> None:
        """Pin the `carrying` marker before anything is preloaded."""
        if not self._marker(CARRYING, create=False):
            self._marker(CARRYING, create=True)

    def end_carry(self) -> None:
        """The old layout is gone: drop both markers."""
        for name in (CARRYING, CARRIED):
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                os.unlink(self.objects.path(name))

    def holds_carry(self) -> bool:
        """Every object was created holding the carry (`carried`) while the old layout may still exist."""
        return self._marker(CARRIED, create=False)

    def install_interrupted(self) -> bool:
        """A migration into this layout began (`carrying`) and did not get to `carried`."""
        return self._marker(CARRYING, create=False) and not self._marker(CARRIED, create=False)

    def follow_installed(self) -> None:
        """Nothing to look for: the pins have one place."""

    # -- changing -----------------------------------------------------------------------------------------------

    def sync(self, desired: Desired) -> Members:
        """Maps (created holding a migration's carry), pod entries, and every interface's hooks in line."""
        carry = desired.carry
        repairing = desired.installed_here and carry is None
        if repairing:
            self.repairs.note("ebpf_map", self.objects.repin_maps())
            with entered(self.host.netns):
                broken = self.objects.broken_links()
            self.objects.drop_links(broken)
            self.repairs.note("ebpf_link", [f"ifindex {i} {d}" for i, d in broken])
        existed = self.objects.open_maps(create=True)
        if repairing:  # before set_pods: the tables still say what the last sync wrote
            self.repairs.note("ebpf_index", self.objects.repair_index())
        if existed:
            self._read()  # what was counted so far goes to the owners it had (a moved address changes owner next)
        _, vanished = self.book.take_vanished()
        members = sync_members(desired, self.book, self._members, keep_synced=desired.installed_here)
        carried_elements: dict[PodEntry, Counts] = {}
        if repairing:  # entries someone deleted: re-created holding the counts last read
            have = set(self.objects.pod_keys())
            gone: list[str] = []
            for family, held in desired.synced.items():
                want = held & members.get(family, set())
                for role in ipsets.COUNTED:
                    name = set_name(role, family)
                    present = (m[0] for m in want if program.pod_key(m[0], role) in have)
                    names, restored = missing_elements(name, want, present, vanished)
                    gone += names
                    carried_elements.update({(m[0], role): v for m, v in restored.items()})
                    if restored:
                        self.book.elements_created_with(name, restored)
            self.repairs.note("ebpf_element", gone)
        if carry is not None and not existed:
            self.objects.preload_node({f: v for f, v in carry.rules.items() if f in self.families})
            for family, values in carry.rules.items():
                self.book.rules_created_with(f"ebpf{family}", values)
            for (role, family), elements in carry.elements.items():
                carried_elements.update({(m[0], role): v for m, v in elements.items()})
                self.book.elements_created_with(set_name(role, family), elements)
        wanted: dict[PodEntry, Counts | None] = {
            (m[0], role): carried_elements.get((m[0], role)) for family in self.families
            for m in members.get(family, set()) for role in ipsets.COUNTED}
        added, removed = self.objects.set_pods(wanted)
        changes = self.objects.sync_hooks(self.families, self.networks)
        if added or removed or changes:
            log.info("netacct: eBPF layout: %d pod entries added, %d removed%s", added, removed,
                     f"; {'; '.join(changes)}" if changes else "")
        if carry is None:
            self.end_carry()  # a finished migration's markers are stale (as the nft sync drops its marker counter)
        elif self._marker(CARRYING, create=False):
            self._marker(CARRIED, create=True)
        return {f: set(m) for f, m in members.items() if f in self.families}

    def _members(self) -> dict[int, set[ipsets.Member]]:
        out: dict[int, set[ipsets.Member]] = {}
        for key in self.objects.pod_keys():
            address, _ = program.parse_pod_key(key)
            family = 4 if len(address) == 4 else 6
            out.setdefault(family, set()).add((address, len(address) * 8))
        return out

    def close(self) -> None:
        """Close the maps, programs and links this process holds (pins and attachments stay)."""
        self.objects.close()

    def remove(self) -> list[str]:
        """Detach and unpin everything of this layout; what was removed."""
        if self.host.bpf_usable() is not None:
            return []
        removed = self.objects.remove()  # also without pins: cls_bpf filters hold their programs themselves
        self.end_carry()
        with contextlib.suppress(OSError):
            os.rmdir(self.objects.bpffs_dir)  # only when empty: the directory may be a bpffs mount point
        self.book.forget(self.sources(), self.set_names())
        if removed:
            log.info("netacct: removed the eBPF layout's objects: %s", ", ".join(removed))
        return removed


def _keys(synced: Mapping[int, set[ipsets.Member]]) -> set[bytes]:
    """The pods map keys a sync for these addresses writes."""
    return {program.pod_key(m[0], role) for members in synced.values() for m in members for role in ipsets.COUNTED}


def _grouped(read: Read) -> dict[tuple[str, int], dict[ipsets.Member, Counts]]:
    """The pods map's entries per (role, family), as the book's set members."""
    out: dict[tuple[str, int], dict[ipsets.Member, Counts]] = {}
    for (address, role), value in read.pods.items():
        out.setdefault((role, 4 if len(address) == 4 else 6), {})[(address, len(address) * 8)] = value
    return out
