"""The index mode (agent.netacct.ebpf.slots): pods whose addresses fit one /16 (/112) are counted through two
arrays the verifier inlines, with no helper call left in the program; the layout's objects read the same totals
whichever mode counted them, through mode switches, base changes and a reopen of the pins. The programs run in the
kernel (BPF_PROG_TEST_RUN) on crafted packets; the maps are the layout's own, pinned on a private bpffs."""

from __future__ import annotations

import ipaddress
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator

import pytest

from agent.config.netacct import NetacctConfig
from agent.host import bpf
from agent.netacct.ebpf import program, slots
from agent.netacct.ebpf.objects import Objects
from tests.netacct import netns

SK_BUFF_SIZE = 192
PEERS = {4: ipaddress.ip_address("203.0.113.9"), 6: ipaddress.ip_address("2001:db8::9")}
NETS = NetacctConfig().internal_networks()
Addr = ipaddress.IPv4Address | ipaddress.IPv6Address


@pytest.fixture
def objects(bpffs: str) -> Iterator[Objects]:
    if os.geteuid() != 0:
        pytest.skip("loading programs needs root")
    made = Objects(os.path.join(bpffs, f"index{os.getpid()}"))
    made.open_maps(create=True)
    yield made
    _unpin(made)


def _unpin(objects: Objects) -> None:
    """Close and unpin the maps (nothing is attached here: remove() would scan the host's interfaces)."""
    objects.close()
    for name in objects.pins():
        os.unlink(objects.path(name))


def _packet(src: Addr, dst: Addr, payload: int = 36) -> bytes:
    if src.version == 4:
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + payload, 0, 0, 64, 17, 0, src.packed, dst.packed)
        return bytes(12) + b"\x08\x00" + ip + bytes(payload)
    ip6 = struct.pack(">IHBB16s16s", 6 << 28, payload, 17, 64, src.packed, dst.packed)
    return bytes(12) + b"\x86\xdd" + ip6 + bytes(payload)


def _set(objects: Objects, addresses: list[str]) -> program.Spec:
    """The pods' entries set, and the egress program (Ethernet) the layout would swap in for them."""
    objects.set_pods({(ipaddress.ip_address(a).packed, role): None for a in addresses for role in program.ROLES})
    return objects.specs((4, 6), NETS)[(program.EGRESS, 14)]


def _send(objects: Objects, s: program.Spec, dst: str, count: int) -> None:
    """`count` forwarded packets from the internet to `dst` through the egress program of `s`."""
    ctx = bytearray(SK_BUFF_SIZE)
    struct.pack_into("<I", ctx, program.SKB_INGRESS_IFINDEX, 7)  # forwarded: an input device
    prog = objects.load(s, clsact=False)
    target = ipaddress.ip_address(dst)
    packet = _packet(PEERS[target.version], target)
    for _ in range(count):
        assert bpf.prog_test_run(prog, packet, ctx=bytes(ctx))[0] == program.RETURN_NEXT


def _rx(objects: Objects, address: str) -> int:
    return objects.read((4, 6)).pods.get((ipaddress.ip_address(address).packed, "rx-inet"), (0, 0))[0]


def _slot_packets(objects: Objects) -> int:
    _, values = bpf.map_dump(objects.maps["slots"], 4, slots.SLOT_VALUE_SIZE * bpf.possible_cpus(), slots.SLOT_ENTRIES)
    columns = slots.sum_columns(values, bpf.possible_cpus(), 8)
    return sum(sum(columns[2 * role]) for role in range(4))


def test_an_indexed_pod_counts_in_its_slot_and_no_call_is_left(objects: Objects) -> None:
    s = _set(objects, ["10.245.3.2", "10.245.9.200", "fd00:245::7"])
    assert dict(s.index) == {4: 1, 6: 1}
    _send(objects, s, "10.245.3.2", 3)
    _send(objects, s, "10.245.9.200", 2)
    _send(objects, s, "fd00:245::7", 4)
    _send(objects, s, "10.245.3.3", 5)  # inside the pods' prefix, no pod: index value 0
    assert (_rx(objects, "10.245.3.2"), _rx(objects, "10.245.9.200"), _rx(objects, "fd00:245::7")) == (3, 2, 4)
    assert _slot_packets(objects) == 9  # the slots counted, not the hash (its entries stay at zero)
    hashed = bpf.map_dump(objects.maps["pods"], program.POD_KEY_SIZE, 16 * bpf.possible_cpus(), 64)[1]
    assert sum(p for p, _ in slots.sum_counts(hashed, bpf.possible_cpus())) == 0
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        pytest.skip("bpftool is not installed")
    prog_id = bpf.prog_info(objects.load(s, clsact=False)).id
    xlated = subprocess.run([bpftool, "prog", "dump", "xlated", "id", str(prog_id)], capture_output=True,
                            text=True, timeout=10, check=True).stdout
    assert "call" not in xlated  # every map lookup of the egress program inlined: node, index, slots


def test_pods_spanning_two_16s_are_counted_in_the_hash(objects: Objects) -> None:
    s = _set(objects, ["10.245.3.2", "10.246.0.2", "fd00:245::7"])
    assert dict(s.index) == {6: 1}  # IPv4 spans two /16s: hash mode; IPv6 still indexed
    _send(objects, s, "10.245.3.2", 2)
    _send(objects, s, "10.246.0.2", 3)
    _send(objects, s, "10.246.0.3", 1)  # inside the prefix, no pod: a failed hash lookup
    assert (_rx(objects, "10.245.3.2"), _rx(objects, "10.246.0.2")) == (2, 3)
    assert _slot_packets(objects) == 0


def test_mode_switches_base_changes_and_a_reopen_keep_totals_exact(objects: Objects) -> None:
    s = _set(objects, ["10.245.3.2"])
    _send(objects, s, "10.245.3.2", 3)  # index mode
    s = _set(objects, ["10.245.3.2", "10.250.0.9"])
    assert s.index == ()
    _send(objects, s, "10.245.3.2", 4)  # hash mode: the slot's 3 stay summed
    _send(objects, s, "10.250.0.9", 1)
    assert (_rx(objects, "10.245.3.2"), _rx(objects, "10.250.0.9")) == (7, 1)
    s = _set(objects, ["10.245.3.2", "10.245.3.77"])
    assert dict(s.index) == {4: 1}  # back in the same /16: same generation, the same slot counts on
    _send(objects, s, "10.245.3.2", 5)
    _send(objects, s, "10.245.3.77", 2)
    assert (_rx(objects, "10.245.3.2"), _rx(objects, "10.245.3.77")) == (12, 2)
    old = s
    s = _set(objects, ["10.247.3.2", "10.247.0.77"])  # a new /16: a new generation
    assert dict(s.index) == {4: 2}
    _send(objects, old, "10.247.3.2", 1)  # the old program, still attached for a moment: last two bytes alias
    _send(objects, old, "10.245.3.2", 1)  # a removed pod's packet: its index entry is gone
    assert (_rx(objects, "10.247.3.2"), _rx(objects, "10.245.3.2")) == (0, 0)
    _send(objects, s, "10.247.3.2", 6)
    assert _rx(objects, "10.247.3.2") == 6  # its slot was zeroed when given out
    objects.close()  # a restarted agent: the slot table comes back from the index maps
    reopened = Objects(objects.bpffs_dir)
    assert reopened.open_maps(create=False)
    assert _rx(reopened, "10.247.3.2") == 6
    s = _set(reopened, ["10.247.3.2", "10.247.0.77"])
    assert dict(s.index) == {4: 2}
    _send(reopened, s, "10.247.3.2", 1)
    assert _rx(reopened, "10.247.3.2") == 7
    reopened.close()
    objects.open_maps(create=False)


def test_a_recreated_hash_entry_holds_the_total_less_its_slot(objects: Objects) -> None:
    """A hash entry created holding a total (a repair, a carry) read with the slot's counts in it: the sum never
    counts the slot's packets twice, and the address's other roles keep theirs."""
    s = _set(objects, ["10.245.3.2"])
    _send(objects, s, "10.245.3.2", 3)
    ctx = bytearray(SK_BUFF_SIZE)
    struct.pack_into("<I", ctx, program.SKB_INGRESS_IFINDEX, 7)
    from_cluster = _packet(ipaddress.ip_address(str(next(iter(NETS))[5])), ipaddress.ip_address("10.245.3.2"))
    assert bpf.prog_test_run(objects.load(s, clsact=False), from_cluster, ctx=bytes(ctx))[0] == program.RETURN_NEXT
    rx_clus = (ipaddress.ip_address("10.245.3.2").packed, "rx-clus")
    assert objects.read((4, 6)).pods[rx_clus][0] == 1
    key = program.pod_key(ipaddress.ip_address("10.245.3.2").packed, "rx-inet")
    assert bpf.map_delete(objects.maps["pods"], key)  # someone deletes it; the repair restores the last read
    objects.set_pods({(ipaddress.ip_address("10.245.3.2").packed, role): (3, 3 * 64) if role == "rx-inet" else None
                      for role in program.ROLES})
    assert _rx(objects, "10.245.3.2") == 3
    _send(objects, objects.specs((4, 6), NETS)[(program.EGRESS, 14)], "10.245.3.2", 2)
    assert _rx(objects, "10.245.3.2") == 5
    assert objects.read((4, 6)).pods[rx_clus][0] == 1


def test_every_index_map_is_pinned_and_removed(objects: Objects) -> None:
    assert objects.pins() == ["index4", "index6", "node", "pods", "slots"]
    ids = [bpf.map_info(fd).id for fd in objects.maps.values()]
    _unpin(objects)
    assert objects.pins() == []
    if shutil.which("bpftool") is None:
        pytest.skip("bpftool is not installed")
    assert [i for i in ids if netns.sh("bpftool", "map", "show", "id", str(i), check=False)] == []
    objects.open_maps(create=True)


def _bpftool_update(objects: Objects, name: str, key: int, value: int) -> None:
    """Someone else's write to an index map (bpftool on the pin)."""
    bpftool = shutil.which("bpftool")
    if bpftool is None:
        pytest.skip("bpftool is not installed")
    hexes = [f"{b:02x}" for b in key.to_bytes(4, "little")] + ["value"] + [
        f"{b:02x}" for b in value.to_bytes(4, "little")]
    subprocess.run([bpftool, "map", "update", "pinned", objects.path(name), "key", "hex", *hexes[:4], "value", "hex",
                    *hexes[5:]], capture_output=True, timeout=10, check=True)


def test_stray_and_record_writes_are_found_within_a_sweep_and_repaired(objects: Objects) -> None:
    s = _set(objects, ["10.245.3.2", "10.245.9.200", "fd00:245::7"])
    _send(objects, s, "10.245.3.2", 3)
    assert not any(objects.index_drifted() for _ in range(slots.SWEEP_STEPS))  # nothing to find untouched
    pod = slots.index_key(ipaddress.ip_address("10.245.3.2").packed)
    stray = slots.index_key(ipaddress.ip_address("10.245.7.7").packed)  # no pod: counted into 10.245.3.2's slot
    value = int.from_bytes(bpf.map_lookup(objects.maps["index4"], pod.to_bytes(4, "little"), 4) or b"", "little")
    _bpftool_update(objects, "index4", stray, value)
    _send(objects, s, "10.245.7.7", 5)
    assert _rx(objects, "10.245.3.2") == 8  # what the stray does until it is cleared
    found = [objects.index_drifted() for _ in range(slots.SWEEP_STEPS)]
    assert any(found)  # within one sweep of the map
    _bpftool_update(objects, "index6", slots.RECORD, 77)  # the record a restart recovers the table from
    assert sorted(objects.repair_index()) == ["index4 10.245.7.7 (no pod)", "index6 record"]
    assert not any(objects.index_drifted() for _ in range(slots.SWEEP_STEPS))
    _send(objects, s, "10.245.7.7", 5)
    _send(objects, s, "10.245.3.2", 1)
    assert _rx(objects, "10.245.3.2") == 9  # the stray no longer counts, the slot kept its counts
    objects.close()
    objects.open_maps(create=False)  # a restart recovers the same tables from the repaired record
    assert dict(objects.specs((4, 6), NETS)[(program.EGRESS, 14)].index or {}) == dict(s.index or {})
