"""The counting programs and their maps, built from the internal CIDRs and the node's addresses.

Maps (shared by every program, pinned by the layout):

- `node`: a per-CPU array of 16 (packets, bytes) slots, one per family x node series (`NODE_KEYS`, the iptables
  layout's rule keys), so the node totals cost an inlined index, not a hash walk;
- `pods`: a per-CPU hash keyed by a pod address (16 bytes, IPv4 in the first 4, the rest zero) and a u32 naming
  the counted role and family (`pod_key`); entries are added by the agent (BPF_NOEXIST keeps an existing count),
  never by the program, so a packet of an address nobody owns costs a failed lookup and no entry.

Programs (BPF_PROG_TYPE_SCHED_CLS, one per hook direction and link-layer header length):

- ingress, on every interface but lo: a packet for the node (one of its addresses, an IPv6 link-local address,
  broadcast or multicast: `pkt_type` != PACKET_HOST) is host input, classified by source; any other unicast
  packet will be forwarded and is counted as the nft layout's forward chain counts it. tc ingress runs before
  routing, so the node's own addresses are compared inline (a second hash lookup per forwarded packet costs about
  as much as the hook itself: reference ebpf-accounting §8); a change of addresses builds new programs, which the
  layout swaps into the same links (no gap, no double count: the counts live in the maps);
- egress: only what the node itself sends (`ingress_ifindex` 0) is counted, as host output by destination.

Bytes are IP-level, as netfilter counts them: `__sk_buff.len` covers the link-layer header at tc, so the
program subtracts its length (14 on Ethernet, 0 on L3 devices). Every program returns -1 (TCX_NEXT /
TC_ACT_UNSPEC): whatever runs after it on the hook still decides the packet's fate.

Known differences from the netfilter layouts, by construction: tc ingress sees addresses before DNAT and tc
egress after SNAT (a forwarded packet is classified by the addresses it arrived with), and a forwarded packet
that routing or a filter later drops is still counted here.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from agent.netacct import ipsets
from agent.netacct.ebpf import asm
from agent.netacct.ebpf.asm import FP, R0, R1, R2, R3, R6, R7, R8, R9, Asm

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

INGRESS, EGRESS = "ingress", "egress"
NODE_KEYS = tuple(f"traffic={cls}-{way} scope={scope}" for cls in ("cluster", "internet") for way in ("in", "out")
                  for scope in ("host", "pod"))
NODE_SLOTS = 2 * len(NODE_KEYS)
VALUE_SIZE = 16  # u64 packets, u64 bytes
POD_KEY_SIZE = 20  # 16-byte address + u32 role
ROLES = ipsets.COUNTED  # rx-inet, tx-inet, rx-clus, tx-clus
RETURN_NEXT = -1  # TCX_NEXT and TC_ACT_UNSPEC: let the next program on the hook decide

# struct __sk_buff offsets (uapi linux/bpf.h)
SKB_LEN, SKB_PKT_TYPE, SKB_PROTOCOL, SKB_INGRESS_IFINDEX, SKB_DATA, SKB_DATA_END = 0, 4, 16, 36, 76, 80
PROTOCOL = {4: 0x0008, 6: 0xDD86}  # ETH_P_IP / ETH_P_IPV6 in network order, read as a little-endian u32
HEADER = {4: 20, 6: 40}
SADDR, DADDR = {4: 12, 6: 8}, {4: 16, 6: 24}
WORDS = {4: 1, 6: 4}
SRC_INTERNAL, DST_INTERNAL = 1, 2  # bits of R8
KEY_AT, SLOT_AT = -24, -4  # stack offsets of the pod key and the node slot index


def node_slot(family: int, key: str) -> int:
    """The `node` array index of a family's node series."""
    return (0 if family == 4 else len(NODE_KEYS)) + NODE_KEYS.index(key)


def slot_key(slot: int) -> tuple[int, str]:
    """(family, node series key) of an array index."""
    return (4 if slot < len(NODE_KEYS) else 6), NODE_KEYS[slot % len(NODE_KEYS)]


def role_code(role: str, family: int) -> int:
    """The u32 after a pod key's address."""
    return ROLES.index(role) | (4 if family == 6 else 0)


def pod_key(address: bytes, role: str) -> bytes:
    """The `pods` map key of a packed address (4 or 16 bytes) and a counted role."""
    family = 4 if len(address) == 4 else 6
    return address.ljust(16, b"\0") + role_code(role, family).to_bytes(4, "little")


def parse_pod_key(key: bytes) -> tuple[bytes, str]:
    """(packed address, role) back from a `pods` key."""
    code = int.from_bytes(key[16:20], "little")
    family = 6 if code & 4 else 4
    return (key[:4] if family == 4 else key[:16]), ROLES[code & 3]


@dataclass(frozen=True)
class Spec:
    """What one program counts: its hook direction, link-layer header length, and the addresses it compares."""

    direction: str
    l2_len: int
    families: tuple[int, ...]
    internal: tuple[Network, ...]
    local: tuple[Address, ...] = ()  # the node's addresses (ingress only)

    @property
    def name(self) -> str:
        """The program's name (15 characters at most): direction, and a digest of everything it compares."""
        text = f"{self.direction}|{self.l2_len}|{self.families}|{sorted(map(str, self.internal))}|" \
               f"{sorted(map(str, self.local))}"
        return f"gna_{'in' if self.direction == INGRESS else 'eg'}_{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def spec(direction: str, l2_len: int, families: Iterable[int], internal: Iterable[Network],
         local: Iterable[Address] = ()) -> Spec:
    """A Spec with its CIDRs collapsed and addresses sorted, so equal inputs give one program name."""
    fams = tuple(sorted(set(families)))
    nets = [n for n in internal if n.version in fams]
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    collapsed: list[Network] = [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]
    addrs = sorted({a for a in local if a.version in fams and not (a.version == 6 and a.is_link_local)},
                   key=lambda a: (a.version, int(a)))
    return Spec(direction, l2_len, fams, tuple(collapsed), tuple(addrs) if direction == INGRESS else ())


def _words(packed: bytes) -> list[int]:
    """Network-order bytes as the little-endian u32 words a packet load returns."""
    return [int.from_bytes(packed[i:i + 4], "little") for i in range(0, len(packed), 4)]


def _match(a: Asm, at: int, packed: bytes, prefix: int, hit: str) -> None:
    """Jump to `hit` when the address at packet offset `at` starts with `prefix` bits of `packed`."""
    miss = a.fresh("miss")
    mask = ((1 << prefix) - 1) << (len(packed) * 8 - prefix) if prefix else 0
    masks = _words(mask.to_bytes(len(packed), "big"))
    values = _words(bytes(x & y for x, y in zip(packed, mask.to_bytes(len(packed), "big"), strict=True)))
    for i, (word_mask, value) in enumerate(zip(masks, values, strict=True)):
        if word_mask == 0:
            break
        a.ldx(4, R2, R7, at + 4 * i)
        if word_mask != 0xFFFFFFFF:
            a.alu32i(asm.AND, R2, word_mask)
        a.jmp32i(asm.JNE, R2, value, miss)
    a.ja(hit)
    a.label(miss)


def _classify(a: Asm, at: int, nets: Iterable[Network], bit: int) -> None:
    """R8 |= bit when the address at packet offset `at` is in one of `nets`."""
    nets = list(nets)
    if not nets:
        return  # nothing is internal: a jump-over block would leave the OR unreachable, which the verifier refuses
    if any(net.prefixlen == 0 for net in nets):
        a.alui(asm.OR, R8, bit)  # everything is internal: compares would leave code unreachable
        return
    hit, done = a.fresh("internal"), a.fresh("classified")
    for net in nets:
        _match(a, at, net.network_address.packed, net.prefixlen, hit)
    a.ja(done)
    a.label(hit)
    a.alui(asm.OR, R8, bit)
    a.label(done)



def _add_to_value(a: Asm) -> None:
    """*R0 += (1 packet, R9 bytes): this CPU's slot, so no atomic is needed (tc runs without preemption)."""
    a.ldx(8, R1, R0, 0)
    a.alui(asm.ADD, R1, 1)
    a.stx(8, R0, 0, R1)
    a.ldx(8, R1, R0, 8)
    a.alu(asm.ADD, R1, R9)
    a.stx(8, R0, 8, R1)


def _count_node(a: Asm, family: int, key: str) -> None:
    skip = a.fresh("node_missing")
    a.st(4, FP, SLOT_AT, node_slot(family, key))
    a.ld_map(R1, "node")
    a.mov(R2, FP)
    a.alui(asm.ADD, R2, SLOT_AT)
    a.call(asm.MAP_LOOKUP_ELEM)
    a.jmpi(asm.JEQ, R0, 0, skip)
    _add_to_value(a)
    a.label(skip)


def _count_pod(a: Asm, family: int, address_at: int, role: str, node_key: str | None) -> None:
    """Count the packet for the pod owning the address at `address_at` in `role` (and the node series `node_key`
    when a pod owns it: cluster traffic is the node's pod-scope traffic only for this node's pods)."""
    skip = a.fresh("no_pod")
    for i in range(4):
        if i < WORDS[family]:
            a.ldx(4, R1, R7, address_at + 4 * i)
            a.stx(4, FP, KEY_AT + 4 * i, R1)
        else:
            a.st(4, FP, KEY_AT + 4 * i, 0)
    a.st(4, FP, KEY_AT + 16, role_code(role, family))
    a.ld_map(R1, "pods")
    a.mov(R2, FP)
    a.alui(asm.ADD, R2, KEY_AT)
    a.call(asm.MAP_LOOKUP_ELEM)
    a.jmpi(asm.JEQ, R0, 0, skip)
    _add_to_value(a)
    if node_key is not None:
        _count_node(a, family, node_key)
    a.label(skip)


def _family(a: Asm, s: Spec, family: int) -> None:
    l2, out = s.l2_len, "out"
    a.ldx(4, R7, R6, SKB_DATA)
    a.ldx(4, R3, R6, SKB_DATA_END)
    a.mov(R2, R7)
    a.alui(asm.ADD, R2, l2 + HEADER[family])
    a.jmp(asm.JGT, R2, R3, out)
    a.ldx(4, R9, R6, SKB_LEN)
    if l2:
        a.alui(asm.ADD, R9, -l2)
    a.movi(R8, 0)
    nets = [n for n in s.internal if n.version == family]
    src, dst = l2 + SADDR[family], l2 + DADDR[family]
    if s.direction == INGRESS:
        _classify(a, src, nets, SRC_INTERNAL)
    _classify(a, dst, nets, DST_INTERNAL)
    if s.direction == EGRESS:
        _host_output(a, family)
    else:
        _ingress(a, s, family, src, dst)


def _host_output(a: Asm, family: int) -> None:
    """Egress: what the node itself sends, by destination class."""
    cluster = a.fresh("to_cluster")
    a.jmpi(asm.JSET, R8, DST_INTERNAL, cluster)
    _count_node(a, family, "traffic=internet-out scope=host")
    a.ja("out")
    a.label(cluster)
    _count_node(a, family, "traffic=cluster-out scope=host")
    a.ja("out")


def _ingress(a: Asm, s: Spec, family: int, src: int, dst: int) -> None:
    """Ingress: host input by source class, or a packet to forward as the nft layout's forward chains count it."""
    out = "out"
    local, forward = a.fresh("local"), a.fresh("forward")
    a.ldx(4, R2, R6, SKB_PKT_TYPE)
    a.jmpi(asm.JNE, R2, 0, local)  # broadcast or multicast (OTHERHOST left at the top)
    if family == 6:
        _match(a, dst, ipaddress.IPv6Address("fe80::").packed, 10, local)
    for address in (x for x in s.local if x.version == family):
        _match(a, dst, address.packed, address.max_prefixlen, local)
    a.ja(forward)
    a.label(local)
    from_cluster = a.fresh("from_cluster")
    a.jmpi(asm.JSET, R8, SRC_INTERNAL, from_cluster)
    _count_node(a, family, "traffic=internet-in scope=host")
    a.ja(out)
    a.label(from_cluster)
    _count_node(a, family, "traffic=cluster-in scope=host")
    a.ja(out)
    # forwarded: the same series as the nft layout's forward chains (nft_layout.desired_rules)
    a.label(forward)
    src_internal, dst_side = a.fresh("src_internal"), a.fresh("dst_side")
    a.jmpi(asm.JSET, R8, SRC_INTERNAL, src_internal)
    _count_node(a, family, "traffic=internet-in scope=pod")
    _count_pod(a, family, dst, "rx-inet", None)
    a.ja(dst_side)
    a.label(src_internal)
    _count_pod(a, family, dst, "rx-clus", "traffic=cluster-in scope=pod")
    a.label(dst_side)
    dst_internal = a.fresh("dst_internal")
    a.jmpi(asm.JSET, R8, DST_INTERNAL, dst_internal)
    _count_node(a, family, "traffic=internet-out scope=pod")
    _count_pod(a, family, src, "tx-inet", None)
    a.ja(out)
    a.label(dst_internal)
    _count_pod(a, family, src, "tx-clus", "traffic=cluster-out scope=pod")
    a.ja(out)


def build(s: Spec) -> Asm:
    """The program for `s`, unassembled (map fds are given at `Asm.assemble`)."""
    a = Asm()
    a.mov(R6, R1)
    if s.direction == INGRESS:
        a.ldx(4, R2, R6, SKB_PKT_TYPE)
        a.jmpi(asm.JEQ, R2, 3, "out")  # PACKET_OTHERHOST: never delivered nor forwarded
    else:
        a.ldx(4, R2, R6, SKB_INGRESS_IFINDEX)
        a.jmpi(asm.JNE, R2, 0, "out")  # forwarded: counted once, where it came in
    a.ldx(4, R2, R6, SKB_PROTOCOL)
    for family in s.families:
        a.jmp32i(asm.JEQ, R2, PROTOCOL[family], f"ipv{family}")
    a.ja("out")
    for family in s.families:
        a.label(f"ipv{family}")
        _family(a, s, family)
    a.label("out")
    a.movi(R0, RETURN_NEXT)
    a.exit()
    return a


def node_counts(slots: Mapping[int, tuple[int, int]], families: Iterable[int]) -> dict[int, dict[str, tuple[int, int]]]:
    """Per family, the node series of the summed `node` array slots."""
    out: dict[int, dict[str, tuple[int, int]]] = {family: {} for family in families}
    for slot, value in slots.items():
        family, key = slot_key(slot)
        if family in out:
            out[family][key] = value
    return out
