"""The eBPF layout's kernel objects: five pinned maps, one program per hook kind, one link (or cls_bpf filter) per
interface and direction, all under one bpffs directory.

    <bpffs_dir>/node                 per-CPU array, the node series (program.NODE_KEYS x family)
    <bpffs_dir>/pods                 per-CPU hash, (pod address, role) -> counts
    <bpffs_dir>/index4, index6       arrays, an address's last two bytes -> slot (index mode, slots.py)
    <bpffs_dir>/slots                per-CPU array, (slot, family, role) -> counts (index mode)
    <bpffs_dir>/link_<ifindex>_in    tcx ingress link of an interface (egress: _eg)

Pins keep maps and links alive while the agent is down, so the programs go on counting and the next start reads
on from the kernel's values. A link pin names the interface by index (pin names cannot hold '.', interface names
can); a pin whose interface is gone is a defunct link (reference ebpf-accounting §7): detached and unlinked at the
next sync. Where LINK_CREATE has no tcx (kernels before 6.6) the programs go into cls_bpf direct-action filters
on clsact instead (agent.host.bpf_tc), which hold their programs without pins.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.host import bpf, bpf_tc
from agent.host.netns import entered
from agent.netacct.ebpf import program, slots
from agent.netacct.ebpf.program import EGRESS, INGRESS

log = logging.getLogger(__name__)

Counts = tuple[int, int]
PodEntry = tuple[bytes, str]  # packed address, counted role
ATTACH = {INGRESS: bpf.TCX_INGRESS, EGRESS: bpf.TCX_EGRESS}
SHORT = {INGRESS: "in", EGRESS: "eg"}
MAX_POD_ENTRIES = 1 << 16  # 8 per pod (2 families x 4 roles): 8,192 pods; entries allocated on insert
TCX_ABSENT = (errno.EINVAL, errno.EOPNOTSUPP, 524)  # 524: ENOTSUPP, the kernel-internal "not supported"
# name -> (type, key size, value size, entries, flags)
SHAPES = {"node": (bpf.MAP_PERCPU_ARRAY, 4, program.VALUE_SIZE, program.NODE_SLOTS, 0),
          "pods": (bpf.MAP_PERCPU_HASH, program.POD_KEY_SIZE, program.VALUE_SIZE, MAX_POD_ENTRIES, bpf.F_NO_PREALLOC),
          "index4": (bpf.MAP_ARRAY, 4, 4, slots.INDEX_SIZE, 0),
          "index6": (bpf.MAP_ARRAY, 4, 4, slots.INDEX_SIZE, 0),
          "slots": (bpf.MAP_PERCPU_ARRAY, 4, slots.SLOT_VALUE_SIZE, slots.SLOT_ENTRIES, 0)}


@functools.lru_cache(maxsize=1 << 16)
def _parse(key: bytes) -> PodEntry:
    """A pods map key decoded (cached: the same keys come back at every read)."""
    return program.parse_pod_key(key)


def _value(counts: Counts, cpus: int) -> bytes:
    """A per-CPU value holding `counts` on CPU 0 (a carried total), zero elsewhere."""
    return struct.pack("<QQ", *counts) + bytes(program.VALUE_SIZE * (cpus - 1))


@dataclass
class Read:
    """One read of both maps: node series per family, and per pod entry."""

    node: dict[int, dict[str, Counts]]
    pods: dict[PodEntry, Counts]


@dataclass
class Objects:
    """The maps, programs and hooks under `bpffs_dir`, seen from network namespace `netns` (None: this one)."""

    bpffs_dir: str
    netns: str | None = None
    tcx: bool | None = None  # None: tcx where LINK_CREATE takes it, else clsact; False: clsact only
    maps: dict[str, int] = field(default_factory=dict)
    _progs: dict[str, int] = field(default_factory=dict)
    _links: dict[tuple[int, str], tuple[int, str]] = field(default_factory=dict)  # (ifindex, dir) -> (fd, prog)
    _cpus: int = field(default_factory=bpf.possible_cpus)
    _pods: set[bytes] | None = None  # the addresses set_pods last wrote (None: not yet, programs look up any)
    _room: int = 1024  # pods map entries per batch call
    _slots: slots.Slots | None = None  # the index mode's slot tables, once the maps are open
    _entries: tuple[bytes, list[PodEntry]] = (b"", [])  # the pods dump's raw keys last read, decoded

    # -- paths and presence -------------------------------------------------------------------------------------

    def path(self, name: str) -> str:
        """A pin path under the directory."""
        return os.path.join(self.bpffs_dir, name)

    def pins(self) -> list[str]:
        """Our pin names present now (the preloaded iterators' *.debug files are not ours)."""
        try:
            names = os.listdir(self.bpffs_dir)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []
        return sorted(n for n in names if n in SHAPES or n.startswith("link_"))

    def _link_path(self, index: int, direction: str) -> str:
        """The pin of our tcx link on an interface (by index) and direction."""
        return self.path(f"link_{index}_{SHORT[direction]}")

    def _pinned_links(self) -> list[tuple[int, str]]:
        """(ifindex, direction) of every link pin present now."""
        out = []
        for name in self.pins():
            if name.startswith("link_"):
                _, index, short = name.split("_")
                out.append((int(index), INGRESS if short == SHORT[INGRESS] else EGRESS))
        return out

    def present(self) -> bool:
        """Whether any pinned map or link of this layout exists (cls_bpf filters hold no pins: not seen here)."""
        return bool(self.pins())

    # -- maps ---------------------------------------------------------------------------------------------------

    def open_maps(self, create: bool) -> bool:
        """Open the pinned maps; with `create`, mount bpffs if needed and create and pin what is missing. Whether
        the maps holding counts (`node`, `pods`) were there already (the index maps of an older agent's pins are
        simply created)."""
        if create:
            bpf.mount_bpffs(self.bpffs_dir)
        found = True
        for name, (kind, key_size, value_size, entries, flags) in SHAPES.items():
            if name in self.maps:
                continue
            try:
                fd = bpf.obj_get(self.path(name))
                info = bpf.map_info(fd)
                if (info.map_type, info.key_size, info.value_size, info.max_entries) != \
                        (kind, key_size, value_size, entries):
                    os.close(fd)
                    raise bpf.BpfError(errno.EINVAL, f"pinned map {self.path(name)} has another shape")
                self.maps[name] = fd
                continue
            except FileNotFoundError:
                found = found and name not in ("node", "pods")
                if not create:
                    continue
            fd = bpf.map_create(kind, key_size, value_size, entries, name=f"gna_{name}", flags=flags)
            bpf.obj_pin(fd, self.path(name))
            self.maps[name] = fd
        if self._slots is None and all(name in self.maps for name in SHAPES):
            self._slots = slots.Slots(self.maps, self._cpus)
            self._slots.load()
        return found

    def preload_node(self, carried: Mapping[int, Mapping[str, Counts]]) -> None:
        """Set node series to carried totals (a migration into this layout, before any program counts)."""
        for family, keys in carried.items():
            for key, value in keys.items():
                slot = program.node_slot(family, key).to_bytes(4, "little")
                bpf.map_update(self.maps["node"], slot, _value(value, self._cpus))

    def set_pods(self, wanted: Mapping[PodEntry, Counts | None]) -> tuple[int, int]:
        """Make the pod entries exactly `wanted` (a value: created holding it; existing entries keep their
        counts). (added, removed). The programs compare the prefix these addresses share: sync_hooks next."""
        fd = self.maps["pods"]
        have = set(self.pod_keys())
        want = {program.pod_key(address, role): value for (address, role), value in wanted.items()}
        added = 0
        for key, total in want.items():
            if key in have:
                continue
            value = total or (0, 0)
            if total and self._slots is not None:  # a total read before: what the slot holds is counted there
                address, role = _parse(key)
                value = self._slots.less(address, program.ROLES.index(role), total)
            added += bpf.map_update(fd, key, _value(value, self._cpus), bpf.NOEXIST)
        self._pods = {address for address, _ in wanted}
        if self._slots is not None:  # after the hash adds, before the deletes (slots.py: the order)
            self._slots.set_addresses(self._pods)
        removed = sum(bpf.map_delete(fd, key) for key in have - set(want))
        return added, removed

    def pod_keys(self) -> list[bytes]:
        """The raw keys of the pods map, from one batch lookup (the drift check runs every second: 8,000 keys at
        1,000 pods took 32 ms one GET_NEXT_KEY syscall each, 2 ms in a batch)."""
        size = program.POD_KEY_SIZE
        keys, _ = self._dump(self.maps["pods"], size, program.VALUE_SIZE * self._cpus, self._room)
        self._room = max(self._room, len(keys) // size + 1)
        return [keys[i:i + size] for i in range(0, len(keys), size)]

    def read(self, families: Iterable[int]) -> Read:
        """The maps, summed over CPUs, with one batch lookup each (decoded a whole buffer at a time: at 1,000 pods
        the pods map is 8,000 entries); a pod's slot counts are added to its hash entry's (slots.py)."""
        size = program.VALUE_SIZE * self._cpus
        keys, values = self._dump(self.maps["node"], 4, size, program.NODE_SLOTS)
        nodes = dict(zip((k for (k,) in struct.iter_unpack("<I", keys)), self._sums(values), strict=True))
        keys, values = self._dump(self.maps["pods"], program.POD_KEY_SIZE, size, self._room)
        self._room = max(self._room, len(keys) // program.POD_KEY_SIZE + 1)  # one call next time
        if self._entries[0] != keys:  # the same keys in the same order as the last read: decoded already
            size = program.POD_KEY_SIZE
            self._entries = (keys, [_parse(keys[i:i + size]) for i in range(0, len(keys), size)])
        entries = self._entries[1]
        packets, octets = slots.sum_columns(values, self._cpus, 2)
        if self._slots is not None:  # an entry someone deleted has no slot added: the repair re-creates it
            packets, octets = self._slots.add_to(keys, entries, packets, octets)
        counts = zip(packets, octets, strict=True)
        return Read(program.node_counts(nodes, families), dict(zip(entries, counts, strict=True)))

    def _sums(self, values: bytes) -> list[Counts]:
        """(packets, bytes) of each per-CPU value in a dump, summed over the CPU slots."""
        return slots.sum_counts(values, self._cpus)

    @staticmethod
    def _dump(fd: int, key_size: int, value_size: int, room: int) -> tuple[bytes, bytes]:
        try:
            return bpf.map_dump(fd, key_size, value_size, room)
        except bpf.BpfError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, 524):
                raise
        found = [(k, v) for k in bpf.map_keys(fd, key_size)  # a kernel before 5.6: one lookup per key
                 if (v := bpf.map_lookup(fd, k, value_size)) is not None]
        return b"".join(k for k, _ in found), b"".join(v for _, v in found)

    # -- programs and hooks -------------------------------------------------------------------------------------

    def specs(self, families: Iterable[int],
              internal: Iterable[program.Network]) -> dict[tuple[str, int], program.Spec]:
        """The program each (direction, link-layer length) needs now (ingress compares the node's addresses; both
        compare the prefix the pod entries share before looking one up, so a sync after set_pods may swap them)."""
        fams, nets = tuple(families), list(internal)
        local = bpf_tc.addresses(self.netns)
        pods = None if self._pods is None else [ipaddress.ip_address(a) for a in self._pods]
        index = self._slots.modes(self._pods) if self._slots is not None and self._pods is not None else None
        return {(d, l2): program.spec(d, l2, fams, nets, local, pods=pods, index=index)
                for d in (INGRESS, EGRESS) for l2 in (0, 14)}

    def load(self, spec: program.Spec, clsact: bool) -> int:
        """The fd of the program for `spec`, loaded once per process (VerifierError: the kernel refused it)."""
        key = spec.name + ("_cls" if clsact else "")
        if key not in self._progs:
            code = program.build(spec).assemble(self.maps)
            attach = 0 if clsact else ATTACH[spec.direction]
            self._progs[key] = bpf.prog_load(bpf.PROG_SCHED_CLS, code, spec.name, attach)
        return self._progs[key]

    def _linked(self, iface: bpf_tc.Iface, direction: str) -> tuple[int, str] | None:
        """Our tcx link on this hook from the cache or its pin: (fd, program name); None when there is none."""
        if (iface.index, direction) in self._links:
            return self._links[(iface.index, direction)]
        try:
            fd = bpf.obj_get(self._link_path(iface.index, direction))
        except FileNotFoundError:
            return None
        info = bpf.link_info(fd)
        name = ""
        try:
            prog = bpf.prog_fd_by_id(info.prog_id)
            name = bpf.prog_info(prog).name
            os.close(prog)
        except bpf.BpfError:
            pass  # without CAP_SYS_ADMIN: the next sync swaps the program in, which is harmless
        if info.ifindex != iface.index:
            name = ""  # defunct (its device is gone); attach below replaces the pin
        self._links[(iface.index, direction)] = (fd, name)
        return fd, name

    def hook(self, iface: bpf_tc.Iface, direction: str, spec: program.Spec) -> str | None:
        """Make the hook run `spec`'s program: create, or swap the program of, our link (tcx) or filter (clsact).
        What changed, or None."""
        if self.tcx is not False:
            with entered(self.netns):
                linked = self._linked(iface, direction)
                if linked is not None and linked[1] == spec.name:
                    return None
                prog = self.load(spec, clsact=False)
                if linked is not None:
                    try:
                        bpf.link_update(linked[0], prog)
                        self._links[(iface.index, direction)] = (linked[0], spec.name)
                        return f"{iface.name} {direction}: program {spec.name}"
                    except bpf.BpfError as exc:
                        if exc.errno not in (errno.ENOLINK, errno.EINVAL):
                            raise
                        self._unpin_link(iface.index, direction)  # defunct: make a fresh one
                try:
                    fd = bpf.link_create(prog, iface.index, ATTACH[direction])
                except bpf.BpfError as exc:
                    if self.tcx is True or exc.errno not in TCX_ABSENT:
                        raise
                    log.info("netacct: no tcx here (%s): attaching with clsact and cls_bpf", exc)
                    self.tcx = False
                else:
                    self.tcx = True
                    path = self._link_path(iface.index, direction)
                    bpf.obj_pin(fd, path)
                    self._links[(iface.index, direction)] = (fd, spec.name)
                    return f"{iface.name} {direction}: tcx link {spec.name}"
        if bpf_tc.cls_attached(iface.index, direction, self.netns) == spec.name:
            return None
        bpf_tc.cls_attach(iface.index, direction, self.load(spec, clsact=True), spec.name, self.netns)
        return f"{iface.name} {direction}: cls_bpf {spec.name}"

    def attach_test(self, iface: bpf_tc.Iface, spec: program.Spec) -> bool:
        """Attach `spec`'s program to the interface and take it off at once (auto's probe): whether tcx took it
        (else clsact did; OSError when neither)."""
        if self.tcx is not False:
            with entered(self.netns):
                try:
                    os.close(bpf.link_create(self.load(spec, clsact=False), iface.index, ATTACH[spec.direction]))
                    return True  # an unpinned link detaches when its only fd closes
                except bpf.BpfError as exc:
                    if self.tcx is True or exc.errno not in TCX_ABSENT:
                        raise
        present = bpf_tc.cls_attached(iface.index, spec.direction, self.netns) is not None
        if not present:  # never take off a filter the layout itself has there
            bpf_tc.cls_attach(iface.index, spec.direction, self.load(spec, clsact=True), spec.name, self.netns)
            bpf_tc.cls_detach(iface.index, spec.direction, self.netns)
        return False

    def _unpin_link(self, index: int, direction: str) -> None:
        cached = self._links.pop((index, direction), None)
        path = self._link_path(index, direction)
        fd = cached[0] if cached else None
        try:
            if fd is None:
                fd = bpf.obj_get(path)
            bpf.link_detach(fd)
        except (FileNotFoundError, bpf.BpfError):
            pass  # already detached (device gone) or never there
        finally:
            if fd is not None:
                os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # -- someone else's changes ----------------------------------------------------------------------------------

    def index_drifted(self) -> bool:
        """Whether someone else changed an index map entry (slots.Slots.index_drift)."""
        return self._slots is not None and bool(self._slots.index_drift())

    def repair_index(self) -> list[str]:
        """Write back the index entries someone else changed: what was repaired (no count moves)."""
        return [] if self._slots is None else self._slots.repair_index()

    def unpinned_maps(self) -> list[str]:
        """Maps this process holds whose pins someone removed (the programs still count into them)."""
        return [name for name in self.maps if not os.path.exists(self.path(name))]

    def repin_maps(self) -> list[str]:
        """Pin again the maps whose pins someone removed: not a count is lost (the programs never stopped)."""
        names = self.unpinned_maps()
        for name in names:
            bpf.obj_pin(self.maps[name], self.path(name))
        return names

    def broken_links(self) -> list[tuple[int, str]]:
        """Links this process attached that someone detached (tcx ifindex 0 while the device lives on: a device
        that is gone is not checked here) or unpinned (the link would detach with this process)."""
        broken = []
        for (index, direction), (fd, _) in self._links.items():
            pinned = os.path.exists(self._link_path(index, direction))
            if pinned and bpf.link_info(fd).ifindex == index:
                continue
            try:
                socket.if_indextoname(index)  # in this thread's namespace: the caller entered the layout's
            except OSError:
                continue  # the device is gone (a pod's veth): no tampering, the next sync drops the link
            broken.append((index, direction))
        return broken

    def drop_links(self, links: Iterable[tuple[int, str]]) -> None:
        """Forget these links (detaching what is left of them), so that the next hook creates them again."""
        for index, direction in links:
            self._unpin_link(index, direction)

    def sync_hooks(self, families: Iterable[int], internal: Iterable[program.Network]) -> list[str]:
        """Every interface's hooks run the current programs; links of interfaces that are gone are removed."""
        if self._pods is None and "pods" in self.maps:  # no set_pods in this process yet: the map says
            self._pods = {_parse(key)[0] for key in self.pod_keys()}
        specs = self.specs(families, internal)
        ifaces = bpf_tc.interfaces(self.netns)
        changes = [change for iface in ifaces for direction in (INGRESS, EGRESS)
                   if (change := self.hook(iface, direction, specs[(direction, iface.l2_len)])) is not None]
        live = {i.index for i in ifaces}
        for index, direction in self._pinned_links():
            if index not in live:
                self._unpin_link(index, direction)
                changes.append(f"ifindex {index}: defunct link removed")
        return changes

    # -- removal ------------------------------------------------------------------------------------------------

    def remove(self) -> list[str]:
        """Detach every link and filter of ours, unlink every pin, drop the directory if empty: what was removed."""
        removed = []
        for index, direction in self._pinned_links():
            with entered(self.netns):
                self._unpin_link(index, direction)
            removed.append(f"tcx link ifindex {index} {SHORT[direction]}")
        try:
            ifaces = bpf_tc.interfaces(self.netns)
        except OSError:
            ifaces = []
        for iface in ifaces:
            for direction in (INGRESS, EGRESS):
                if bpf_tc.cls_detach(iface.index, direction, self.netns):
                    removed.append(f"cls_bpf {iface.name} {direction}")
        self.close()
        for name in self.pins():
            os.unlink(self.path(name))
            removed.append(f"map {name}")
        return removed

    def close(self) -> None:
        """Close every fd this process holds (pins and attachments stay)."""
        for fd in [*self.maps.values(), *self._progs.values(), *(fd for fd, _ in self._links.values())]:
            os.close(fd)
        self.maps.clear()
        self._slots = None
        self._progs.clear()
        self._links.clear()
