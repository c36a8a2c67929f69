"""Pod counters the programs reach through two inlined array lookups instead of a hash lookup (the index mode).

Why: on a kernel with retpolines and safe-RET mitigations a per-packet helper call is expensive; the verifier
inlines ARRAY and PERCPU_ARRAY lookups into index arithmetic (`bpftool prog dump xlated` shows no call left),
so a pod counted through them costs about what the hook alone costs (bench/nft_shapes.py).

Maps (pinned beside `node` and `pods`):

- `index4`, `index6`: arrays of u32, one entry per value of an address's last two bytes (read from the packet as
  one little-endian u16, `index_key`); the value is `(generation << 16) | (slot + 1)`, 0 meaning no pod. Entries
  past the 65,536 hold the record `(generation + 1, the base address's four words)`, so a restarted agent
  recovers its slot table from the map alone;
- `slots`: a per-CPU array, index `slot * 2 + family bit` (`slot_index`), whose value holds (packets, bytes) for
  each of the four roles (ROLES order): one entry per address (a batch read costs per entry: 2,000 entries of 64
  bytes read in a quarter of the time of 8,000 of 16), both families interleaved so that one batch read of the
  leading entries covers every slot in use.

A family is in index mode when all its pod addresses lie in one /16 (IPv4) or /112 (IPv6) (`index_base`) and
there are at most MAX_SLOT_ADDRESSES of them; otherwise its programs look pods up in the hash as before. Every
pod keeps its hash entries either way: a program counts into one of the two, the reader sums both per (address,
role), so a switch of modes moves nothing and loses nothing. A hash entry re-created holding a total (a repair
of someone's delete, a carry) holds that total less what the slot holds (`less`), so the sum never counts twice.

The generation tags index values: a program built for generation g counts only values tagged g, so when the base
changes (new generation) programs still attached for the old base cannot count one address into another's slot.
Order, so that no packet is counted into the wrong slot: a removed pod's index entry is cleared before its hash
entry and before its slot is reused (not in the same sync: a packet in flight may still add to it); a slot is
zeroed on every CPU before its index entry is written. Entries of a family that left index mode stay, frozen:
they still name the slots whose counts the reader adds.

Someone else's writes (bpftool) to an index map would silently stop a pod's counting (a zeroed entry) or count it,
or an address that is no pod, into another slot: `index_drift` compares the map with what this process wrote, in
the engine's periodic check, and `repair_index` writes it back (the slots are untouched: no count is lost). The
check reads every entry written (one lookup each, the record in one batch call) and a 1/SWEEP_STEPS part of the
map, another part each time (a stray entry is found within SWEEP_STEPS checks): a batch read of a whole map
(65,541 entries) costs about 15 ms, a part about 1 ms (README, Hostile input).
"""

from __future__ import annotations

import array
import ipaddress
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from agent.host import bpf
from agent.netacct import ipsets

Counts = tuple[int, int]
INDEX_ENTRIES = 1 << 16  # one per value of an address's last two bytes
RECORD = INDEX_ENTRIES  # generation + 1 (0: none), then the base address as four u32 words
INDEX_SIZE = RECORD + 5
MAX_SLOT_ADDRESSES = 1024  # per family
ROLE_COUNT = 4
VALUE_SIZE = 16  # u64 packets, u64 bytes
SLOT_VALUE_SIZE = ROLE_COUNT * VALUE_SIZE
SLOT_ENTRIES = 2 * MAX_SLOT_ADDRESSES
INDEX_PREFIX = {4: 16, 6: 112}
ROLES_AT = {role: i for i, role in enumerate(ipsets.COUNTED)}  # program.ROLES order
GENERATIONS = 1 << 16
SWEEP_STEPS = 16  # parts of an index map, one read per drift check beside the entries written


def index_map(family: int) -> str:
    """The index map's name (and pin) of a family."""
    return f"index{family}"


def index_key(packed: bytes) -> int:
    """An address's index: its last two bytes as the program loads them (one little-endian u16 load)."""
    return int.from_bytes(packed[-2:], "little")


def slot_index(family: int, slot: int) -> int:
    """The `slots` array index of a family's slot (its value: the four roles' counts, program.ROLES order)."""
    return slot * 2 + (1 if family == 6 else 0)


def tag(generation: int) -> int:
    """What an index value holds beside slot + 1."""
    return generation << 16


def index_base(addresses: Iterable[bytes], family: int) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    """The /16 (IPv4) or /112 (IPv6) holding every one of a family's pod addresses, when they fit index mode."""
    values = {int.from_bytes(a, "big") for a in addresses if len(a) == (4 if family == 4 else 16)}
    if not values or len(values) > MAX_SLOT_ADDRESSES:
        return None
    shift = (32 if family == 4 else 128) - INDEX_PREFIX[family]
    if min(values) >> shift != max(values) >> shift:
        return None
    kind = ipaddress.IPv4Network if family == 4 else ipaddress.IPv6Network
    return kind((min(values) >> shift << shift, INDEX_PREFIX[family]))


@dataclass
class Table:
    """A family's slots: the base its index describes, the generation tagging its values, address -> slot."""

    family: int
    generation: int = 0
    base: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None
    slots: dict[bytes, int] = field(default_factory=dict)
    cooling: set[int] = field(default_factory=set)  # freed in this sync: reused from the next one

    def address(self, key: int) -> bytes:
        """The packed address of an index key under the base."""
        assert self.base is not None
        return self.base.network_address.packed[:-2] + key.to_bytes(2, "little")


@dataclass
class Slots:
    """The index and slot maps of both families (fds in `maps`: index4, index6, slots)."""

    maps: dict[str, int]
    cpus: int
    tables: dict[int, Table] = field(default_factory=lambda: {4: Table(4), 6: Table(6)})
    _positions: list[bytes | None] | None = None  # the address owning each slots index (cached)
    _gather: tuple[list[bytes | None], bytes, Callable[[array.array[int]], Iterable[int]]] | None = None
    _sweep: int = 0  # drift checks so far: the part of the maps the next one reads
    _strays: dict[int, set[int]] = field(default_factory=dict)  # family -> stray keys seen, until repaired

    def load(self) -> None:
        """The slot tables back from the index maps (an agent restart): the record, then every entry tagged with
        its generation (an entry tagged otherwise is a leftover of an interrupted base change: cleared)."""
        self._positions = None
        for family, table in self.tables.items():
            fd = self.maps[index_map(family)]
            keys, values = bpf.map_dump(fd, 4, 4, INDEX_SIZE)
            entries = dict(zip(array.array("I", keys), array.array("I", values), strict=True))
            table.slots.clear()
            if not entries.get(RECORD):
                continue
            table.generation = entries[RECORD] - 1
            words = b"".join(entries.get(RECORD + i, 0).to_bytes(4, "little") for i in range(1, 5))
            packed = words[:4] if family == 4 else words
            table.base = ipaddress.ip_network((ipaddress.ip_address(packed), INDEX_PREFIX[family]))
            for key in range(INDEX_ENTRIES):
                value = entries.get(key, 0)
                if not value:
                    continue
                if value >> 16 != table.generation or not 0 < value & 0xFFFF <= MAX_SLOT_ADDRESSES:
                    bpf.map_update(fd, key.to_bytes(4, "little"), bytes(4))
                    continue
                table.slots[table.address(key)] = (value & 0xFFFF) - 1

    def modes(self, addresses: Iterable[bytes]) -> dict[int, int]:
        """family -> generation of the families whose programs can count through the index now: every address
        of the family lies under the recorded base and holds a slot."""
        addresses = set(addresses)
        out = {}
        for family, table in self.tables.items():
            mine = {a for a in addresses if len(a) == (4 if family == 4 else 16)}
            if mine and table.base == index_base(mine, family) and mine <= table.slots.keys():
                out[family] = table.generation
        return out

    def less(self, address: bytes, role_number: int, counts: Counts) -> Counts:
        """`counts` (a total read before, slot included) less what the address's slot holds now for the role: the
        value a re-created hash entry takes so that hash + slot is the total again."""
        table = self.tables[4 if len(address) == 4 else 6]
        if address not in table.slots:
            return counts
        key = slot_index(table.family, table.slots[address]).to_bytes(4, "little")
        raw = bpf.map_lookup(self.maps["slots"], key, SLOT_VALUE_SIZE * self.cpus) or bytes(SLOT_VALUE_SIZE * self.cpus)
        columns = sum_columns(raw, self.cpus, 2 * ROLE_COUNT)
        packets, octets = columns[2 * role_number][0], columns[2 * role_number + 1][0]
        return max(counts[0] - packets, 0), max(counts[1] - octets, 0)

    def set_addresses(self, addresses: Iterable[bytes]) -> None:
        """Slots for `addresses` where their family fits index mode, removed addresses' slots cleared: after the
        hash adds, before the hash deletes."""
        addresses = set(addresses)
        self._positions = None
        for family, table in self.tables.items():
            table.cooling.clear()
            mine = {a for a in addresses if len(a) == (4 if family == 4 else 16)}
            for address in [a for a in table.slots if a not in mine]:
                self._clear(table, address)
            base = index_base(mine, family)
            if base is None:
                continue  # hash mode: the entries of pods that stay keep naming their slots (frozen, summed)
            if base != table.base:  # no address of the old base is wanted: all were cleared above
                table.generation = (table.generation + 1) % GENERATIONS
                table.base = base
                self._write_record(table)
            free = sorted(set(range(MAX_SLOT_ADDRESSES)) - set(table.slots.values()) - table.cooling, reverse=True)
            if len(free) < len(mine - table.slots.keys()):
                continue  # slots freed in this sync are not reused yet: hash mode until the next sync
            for address in sorted(mine - table.slots.keys()):
                slot = free.pop()
                bpf.map_update(self.maps["slots"], slot_index(family, slot).to_bytes(4, "little"),
                               bytes(SLOT_VALUE_SIZE * self.cpus))
                value = tag(table.generation) | (slot + 1)
                bpf.map_update(self.maps[index_map(family)], index_key(address).to_bytes(4, "little"),
                               value.to_bytes(4, "little"))
                table.slots[address] = slot

    def _clear(self, table: Table, address: bytes) -> None:
        """The index entry first (the programs stop counting the address), then the slot is free (next sync)."""
        bpf.map_update(self.maps[index_map(table.family)], index_key(address).to_bytes(4, "little"), bytes(4))
        table.cooling.add(table.slots.pop(address))

    def _write_record(self, table: Table) -> None:
        assert table.base is not None
        fd = self.maps[index_map(table.family)]
        packed = table.base.network_address.packed.ljust(16, b"\0")
        for i in range(4):
            bpf.map_update(fd, (RECORD + 1 + i).to_bytes(4, "little"), packed[4 * i:4 * i + 4])
        bpf.map_update(fd, RECORD.to_bytes(4, "little"), (table.generation + 1).to_bytes(4, "little"))

    @staticmethod
    def expected(table: Table) -> dict[int, int]:
        """key -> value of every non-zero index entry this process wrote (pods' entries, the record)."""
        out = {index_key(a): tag(table.generation) | (slot + 1) for a, slot in table.slots.items()}
        if table.base is not None:
            packed = table.base.network_address.packed.ljust(16, b"\0")
            out[RECORD] = table.generation + 1
            out.update({RECORD + 1 + i: int.from_bytes(packed[4 * i:4 * i + 4], "little") for i in range(4)})
        return out

    def index_drift(self) -> dict[int, dict[int, int]]:
        """family -> {key: value found} of the index entries that differ from what this process wrote: every entry
        written, the record, strays seen before, and the next 1/SWEEP_STEPS part of the map (module docstring)."""
        width = INDEX_ENTRIES // SWEEP_STEPS
        start = self._sweep % SWEEP_STEPS * width
        self._sweep += 1
        out: dict[int, dict[int, int]] = {}
        for family, table in self.tables.items():
            fd, want = self.maps[index_map(family)], self.expected(table)
            found: dict[int, int] = {}
            for key in [k for k in want if k < RECORD] + sorted(self._strays.get(family, ())):
                value = bpf.map_lookup(fd, key.to_bytes(4, "little"), 4)
                found[key] = int.from_bytes(value or bytes(4), "little")
            _, record = bpf.map_dump(fd, 4, 4, INDEX_SIZE - RECORD, once=True, start=RECORD)
            found.update(zip(range(RECORD, INDEX_SIZE), array.array("I", record), strict=True))
            if table.base is not None:  # only a family with a base ever counts through its index
                _, raw = bpf.map_dump(fd, 4, 4, width, once=True, start=start)
                part = array.array("I", bytes(4 * width))
                for key in (k for k in want if start <= k < start + width):
                    part[key - start] = want[key]
                if raw != part.tobytes():  # compared in C: the loop below runs only on a difference
                    found.update((start + i, v) for i, v in enumerate(array.array("I", raw)) if v != part[i])
            drift = {key: value for key, value in found.items() if value != want.get(key, 0)}
            self._strays.setdefault(family, set()).update(k for k in drift if k < RECORD and k not in want)
            if drift:
                out[family] = drift
        return out

    def repair_index(self) -> list[str]:
        """Write back every index entry someone else changed (as index_drift finds them): what was repaired."""
        repaired = []
        for family, drift in self.index_drift().items():
            table, fd = self.tables[family], self.maps[index_map(family)]
            want = self.expected(table)
            for key in sorted(drift):
                bpf.map_update(fd, key.to_bytes(4, "little"), want.get(key, 0).to_bytes(4, "little"))
                what = "record" if key >= RECORD else f"entry {key}" if table.base is None else str(
                    ipaddress.ip_address(table.address(key))) + ("" if key in want else " (no pod)")
                repaired.append(f"{index_map(family)} {what}")
        self._strays.clear()
        return repaired

    def add_to(self, keys: bytes, entries: Sequence[tuple[bytes, str]], packets: array.array[int],
               octets: array.array[int]) -> tuple[array.array[int], array.array[int]]:
        """The `pods` dump's summed columns (`keys` its raw keys, `entries` them decoded, in order) plus each
        entry's slot counts: one batch call over the leading `slots` entries (allocated lowest first), then C-level
        gathers and adds through an index list kept while the dump's keys and the tables stay the same (a per-entry
        Python loop over 8,000 counters costs more than the rest of the read)."""
        owners = self._owners()
        if not owners or not entries:
            return packets, octets
        _, values = bpf.map_dump(self.maps["slots"], 4, SLOT_VALUE_SIZE * self.cpus, len(owners), once=True)
        columns = sum_columns(values, self.cpus, 2 * ROLE_COUNT)
        slot_packets, slot_octets = array.array("Q"), array.array("Q")
        for role in range(ROLE_COUNT):
            slot_packets.extend(columns[2 * role])
            slot_octets.extend(columns[2 * role + 1])
        slot_packets.append(0)  # what an entry without a slot gathers
        slot_octets.append(0)
        if self._gather is None or self._gather[0] is not owners or self._gather[1] != keys:
            where = {address: i for i, address in enumerate(owners) if address is not None}
            zero, width = ROLE_COUNT * len(owners), len(owners)
            indexes = [zero if (i := where.get(address)) is None else ROLES_AT[role] * width + i
                       for address, role in entries]
            pick = operator.itemgetter(*indexes)
            self._gather = (owners, keys, pick if len(indexes) > 1 else lambda column: (pick(column),))
        gather = self._gather[2]
        return (array.array("Q", map(operator.add, packets, gather(slot_packets))),
                array.array("Q", map(operator.add, octets, gather(slot_octets))))

    def _owners(self) -> list[bytes | None]:
        """Per `slots` index up to the last one in use, its address (None: free); cached until the tables
        change."""
        if self._positions is None:
            used = [(a, family, slot) for family, t in self.tables.items() for a, slot in t.slots.items()]
            size = (max((slot for _, _, slot in used), default=-1) + 1) * 2
            positions: list[bytes | None] = [None for _ in range(size)]
            for address, family, slot in used:
                positions[slot_index(family, slot)] = address
            self._positions = positions
        return self._positions


def sum_columns(values: bytes, cpus: int, width: int) -> list[array.array[int]]:
    """Per u64 column of a per-CPU value `width` words wide, its values in a dump summed over the CPU slots
    (C-level loops: a read of a thousand pods decodes 16,000 counters)."""
    words = array.array("Q")
    words.frombytes(values)
    step = width * cpus
    columns = []
    for column in range(width):
        total = words[column::step]
        for cpu in range(1, cpus):
            total = array.array("Q", map(operator.add, total, words[width * cpu + column::step]))
        columns.append(total)
    return columns


def sum_counts(values: bytes, cpus: int) -> list[Counts]:
    """(packets, bytes) of each per-CPU (packets, bytes) value in a dump, summed over the CPU slots."""
    return list(zip(*sum_columns(values, cpus, 2), strict=True))

