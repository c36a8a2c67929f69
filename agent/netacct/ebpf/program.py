"""The counting programs and their maps, built from the internal CIDRs and the node's addresses.

Maps (shared by every program, pinned by the layout; keys in agent.netacct.ebpf.keys and .slots):

- `node`: a per-CPU array of 16 (packets, bytes) slots, one per family x node series (`NODE_KEYS`, the iptables
  layout's rule keys), so the node totals cost an inlined index, not a hash walk;
- `pods`: a per-CPU hash keyed by a pod address (16 bytes, IPv4 in the first 4, the rest zero) and a u32 naming
  the counted role and family (`pod_key`); entries are added by the agent (BPF_NOEXIST keeps an existing count),
  never by the program, so a packet of an address nobody owns costs a failed lookup and no entry;
- `index4` / `index6` and `slots`: arrays the verifier inlines (slots.py). When every pod address of a family
  lies in one /16 (IPv4) or /112 (IPv6), at most 1,024 of them (the index mode, `Spec.index`), a pod is counted
  by its address's last two bytes -> slot -> a per-CPU array entry: two index computations instead of a hash
  lookup, which on a kernel with retpolines and safe-RET costs a helper call and a jhash (~75 ns per packet).
  Otherwise the family's pods are counted in the hash (the hash mode). The reader sums both per (pod, role).

Programs (BPF_PROG_TYPE_SCHED_CLS, one per hook direction and link-layer header length, on every interface but lo):

- ingress: a packet for the node is host input, classified by source: broadcast or multicast (`pkt_type`), an
  IPv6 link-local destination, or one of the node's addresses (compared inline) that a local socket takes
  (`bpf_sk_lookup_tcp/udp`; not TCP/UDP: host input). A TCP/UDP packet for a node address that no socket takes is
  a reply to masqueraded pod traffic (or DNAT'ed): conntrack rewrites it after this hook and routing forwards
  it. Any other unicast packet will be forwarded: its *source side* is counted here, before SNAT, where its
  source is the one netfilter's forward hook sees (internet-in scope=pod, the source pod's tx-* entry,
  cluster-out scope=pod);
- egress: what the node itself sends (`ingress_ifindex` 0) is host output by destination; a forwarded packet has
  its *destination side* counted here, after DNAT and conntrack's reverse NAT, where its destination is the one
  the forward hook sees (internet-out scope=pod, the destination pod's rx-* entry, cluster-in scope=pod).

So a forwarded packet is counted once on each side, in the same series as the nft layout's forward chains. A pod
entry is looked up only for an address inside the prefix all pod entries share (`pod_prefixes`, the node's pod
CIDR in practice, compared inline): the internet side of a forwarded packet, or a pod on another node, costs a
compare instead of a lookup, so pod <-> internet traffic does one pod lookup per packet (in index mode: two
inlined array lookups, no call; an address inside the prefix that is no pod finds index value 0). The
internal CIDRs and the node's addresses are compared inline (a second hash lookup per forwarded packet costs
about as much as the hook itself: reference ebpf-accounting §8); a change of them builds new programs, which the
layout swaps into the same links (no gap, no double count: the counts live in the maps); so does a change of the
pods' prefix or of a family's mode, made in the sync that adds the entries.

Bytes are IP-level, as netfilter counts them: `__sk_buff.len` covers the link-layer header at tc, so the
program subtracts its length (14 on Ethernet, 0 on L3 devices). Every program returns -1 (TCX_NEXT /
TC_ACT_UNSPEC): whatever runs after it on the hook still decides the packet's fate.

Known differences from the netfilter layouts, by construction: a forwarded packet that a filter drops between the
hooks has its source side counted and not its destination side; a packet both DNAT'ed and SNAT'ed on the node
(a NodePort with masquerade) is classified at egress by its rewritten source; a TCP/UDP packet for a node address
with no socket to take it (a closed port) counts as forwarded traffic's source side instead of host input; IPv4
packets with options or fragments and IPv6 packets with extension headers for a node address are host input.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from agent.netacct.ebpf import asm
from agent.netacct.ebpf.asm import FP, R0, R1, R2, R3, R4, R5, R6, R7, R8, R9, Asm
from agent.netacct.ebpf.keys import (
    NODE_KEYS,
    NODE_SLOTS,
    POD_KEY_SIZE,
    ROLES,
    VALUE_SIZE,
    node_counts,
    node_slot,
    parse_pod_key,
    pod_key,
    role_code,
    slot_key,
)
from agent.netacct.ebpf.slots import MAX_SLOT_ADDRESSES, index_map, slot_index, tag
from agent.netacct.ebpf.specs import EGRESS, INGRESS, MAX_POD_PREFIX, Address, Network, Spec, pod_prefixes, spec

__all__ = [
    "EGRESS",
    "INGRESS",
    "MAX_POD_PREFIX",
    "NODE_KEYS",
    "NODE_SLOTS",
    "POD_KEY_SIZE",
    "ROLES",
    "VALUE_SIZE",
    "Address",
    "Network",
    "Spec",
    "build",
    "node_counts",
    "node_slot",
    "parse_pod_key",
    "pod_key",
    "pod_prefixes",
    "role_code",
    "slot_key",
    "spec",
]


RETURN_NEXT = -1  # TCX_NEXT and TC_ACT_UNSPEC: let the next program on the hook decide

# struct __sk_buff offsets (uapi linux/bpf.h)
SKB_LEN, SKB_PKT_TYPE, SKB_PROTOCOL, SKB_INGRESS_IFINDEX, SKB_DATA, SKB_DATA_END = 0, 4, 16, 36, 76, 80
PROTOCOL = {4: 0x0008, 6: 0xDD86}  # ETH_P_IP / ETH_P_IPV6 in network order, read as a little-endian u32
HEADER = {4: 20, 6: 40}
SADDR, DADDR = {4: 12, 6: 8}, {4: 16, 6: 24}
WORDS = {4: 1, 6: 4}
SRC_INTERNAL, DST_INTERNAL = 1, 2  # bits of R8
KEY_AT, SLOT_AT, TUPLE_AT = -24, -4, -64  # stack offsets of the pod key, the node slot index, a socket tuple
PROTO_AT = {4: 9, 6: 6}  # IPv4 protocol, IPv6 next header
SK_LOOKUP_TCP, SK_LOOKUP_UDP, SK_RELEASE = 84, 85, 86  # helpers (enum bpf_func_id)


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



def _add_to_value(a: Asm, at: int = 0) -> None:
    """*(R0 + at) += (1 packet, R9 bytes): this CPU's slot, so no atomic is needed (tc runs without preemption)."""
    a.ldx(8, R1, R0, at)
    a.alui(asm.ADD, R1, 1)
    a.stx(8, R0, at, R1)
    a.ldx(8, R1, R0, at + 8)
    a.alu(asm.ADD, R1, R9)
    a.stx(8, R0, at + 8, R1)


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


def _count_pod(a: Asm, s: Spec, family: int, address_at: int, role: str, *, node_key: str | None = None) -> None:
    """Count the packet for the pod owning the address at `address_at` in `role` (and the node series `node_key`
    when a pod owns it: cluster traffic is the node's pod-scope traffic only for this node's pods)."""
    skip = a.fresh("no_pod")
    if s.pods is not None:
        prefix = next((n for n in s.pods if n.version == family), None)
        if prefix is None:
            return  # no pod of this family: nothing to look up
        if prefix.prefixlen:
            maybe = a.fresh("maybe_pod")
            _match(a, address_at, prefix.network_address.packed, prefix.prefixlen, maybe)
            a.ja(skip)
            a.label(maybe)
    generation = dict(s.index).get(family)
    if generation is not None:
        _indexed(a, family, address_at, generation=generation, skip=skip)
        _add_to_value(a, VALUE_SIZE * ROLES.index(role))  # a slot's value holds the four roles
    else:
        _hashed(a, family, address_at, role, skip)
        _add_to_value(a)
    if node_key is not None:
        _count_node(a, family, node_key)
    a.label(skip)


def _indexed(a: Asm, family: int, address_at: int, *, generation: int, skip: str) -> None:
    """R0 = the address's slot value through two inlined array lookups (slots.py), or go to `skip`.
    Inside the pods' prefix (compared before) and a /16 or /112, the last two bytes name the address."""
    a.ldx(2, R1, R7, address_at + 4 * WORDS[family] - 2)
    a.stx(4, FP, SLOT_AT, R1)
    a.ld_map(R1, index_map(family))
    a.mov(R2, FP)
    a.alui(asm.ADD, R2, SLOT_AT)
    a.call(asm.MAP_LOOKUP_ELEM)  # inlined by the verifier: an ARRAY
    a.jmpi(asm.JEQ, R0, 0, skip)
    a.ldx(4, R1, R0, 0)
    a.alu32i(asm.ADD, R1, -(tag(generation) + 1) & 0xFFFFFFFF)  # 0 (no pod) and other generations wrap high
    a.jmp32i(asm.JGE, R1, MAX_SLOT_ADDRESSES, skip)
    a.alu32i(asm.LSH, R1, 1)  # slot_index: slot * 2 + family bit
    if slot_index(family, 0):
        a.alu32i(asm.ADD, R1, slot_index(family, 0))
    a.stx(4, FP, SLOT_AT, R1)
    a.ld_map(R1, "slots")
    a.mov(R2, FP)
    a.alui(asm.ADD, R2, SLOT_AT)
    a.call(asm.MAP_LOOKUP_ELEM)  # inlined by the verifier: a PERCPU_ARRAY (kernel 6.10 or later)
    a.jmpi(asm.JEQ, R0, 0, skip)


def _hashed(a: Asm, family: int, address_at: int, role: str, skip: str) -> None:
    """R0 = the address's `pods` hash value for `role` (a helper call), or go to `skip`."""
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
    _classify(a, src, nets, SRC_INTERNAL)
    _classify(a, dst, nets, DST_INTERNAL)
    if s.direction == EGRESS:
        _egress(a, s, family, dst)
    else:
        _ingress(a, s, family, src, dst)


def _egress(a: Asm, s: Spec, family: int, dst: int) -> None:
    """Egress: what the node itself sends (`ingress_ifindex` 0) is host output by destination class; a forwarded
    packet has its destination side counted here, after routing and DNAT (and conntrack's reverse NAT of replies),
    where its destination is the one netfilter's forward hook sees."""
    forwarded = a.fresh("forwarded")
    a.ldx(4, R2, R6, SKB_INGRESS_IFINDEX)
    a.jmpi(asm.JNE, R2, 0, forwarded)
    cluster = a.fresh("to_cluster")
    a.jmpi(asm.JSET, R8, DST_INTERNAL, cluster)
    _count_node(a, family, "traffic=internet-out scope=host")
    a.ja("out")
    a.label(cluster)
    _count_node(a, family, "traffic=cluster-out scope=host")
    a.ja("out")
    a.label(forwarded)
    to_internet_done = a.fresh("to_internet_done")
    a.jmpi(asm.JSET, R8, DST_INTERNAL, to_internet_done)
    _count_node(a, family, "traffic=internet-out scope=pod")
    a.label(to_internet_done)
    src_internal = a.fresh("src_internal")
    a.jmpi(asm.JSET, R8, SRC_INTERNAL, src_internal)
    _count_pod(a, s, family, dst, "rx-inet")
    a.ja("out")
    a.label(src_internal)
    _count_pod(a, s, family, dst, "rx-clus", node_key="traffic=cluster-in scope=pod")
    a.ja("out")


def _socket_lookup(a: Asm, family: int, l2: int, local: str, forward: str) -> None:
    """A TCP/UDP packet addressed to the node is host input only if a local socket takes it; without one it is a
    reply to a masqueraded connection (or DNAT'ed), which conntrack rewrites and routing forwards. Anything else
    for the node's addresses (ICMP, IPv4 options or fragments, IPv6 extension headers) is host input."""
    if family == 4:
        a.ldx(1, R2, R7, l2)
        a.alu32i(asm.AND, R2, 0x0F)
        a.jmp32i(asm.JNE, R2, 5, local)  # IPv4 options: the ports are not where the tuple is read
        a.ldx(2, R2, R7, l2 + 6)
        a.alu32i(asm.AND, R2, 0xFF1F)  # fragment offset (network order, read little-endian)
        a.jmp32i(asm.JNE, R2, 0, local)
    a.ldx(1, R2, R7, l2 + PROTO_AT[family])
    tcp = a.fresh("tcp")
    a.jmp32i(asm.JEQ, R2, 6, tcp)
    a.jmp32i(asm.JNE, R2, 17, local)
    a.label(tcp)
    a.ldx(4, R3, R6, SKB_DATA_END)
    a.mov(R4, R7)
    a.alui(asm.ADD, R4, l2 + HEADER[family] + 4)
    a.jmp(asm.JGT, R4, R3, local)
    words = 2 * WORDS[family]  # source and destination address, then both ports as one word
    for i in range(words):
        a.ldx(4, R3, R7, l2 + SADDR[family] + 4 * i)
        a.stx(4, FP, TUPLE_AT + 4 * i, R3)
    a.ldx(4, R3, R7, l2 + HEADER[family])
    a.stx(4, FP, TUPLE_AT + 4 * words, R3)
    # R2 still holds the protocol: 6 or 17
    a.mov(R1, R6)
    a.mov(R0, R2)
    a.mov(R2, FP)
    a.alui(asm.ADD, R2, TUPLE_AT)
    a.movi(R3, 4 * words + 4)
    a.movi(R4, -1)  # BPF_F_CURRENT_NETNS
    a.movi(R5, 0)
    udp, found = a.fresh("udp"), a.fresh("found")
    a.jmpi(asm.JNE, R0, 6, udp)
    a.call(SK_LOOKUP_TCP)
    a.ja(found)
    a.label(udp)
    a.call(SK_LOOKUP_UDP)
    a.label(found)
    a.jmpi(asm.JEQ, R0, 0, forward)
    a.mov(R1, R0)
    a.call(SK_RELEASE)
    a.ja(local)


def _ingress(a: Asm, s: Spec, family: int, src: int, dst: int) -> None:
    """Ingress: host input by source class; a packet to forward has its source side counted here, before SNAT,
    where its source is the one netfilter's forward hook sees (the destination side is counted at egress)."""
    out = "out"
    local, forward = a.fresh("local"), a.fresh("forward")
    a.ldx(4, R2, R6, SKB_PKT_TYPE)
    a.jmpi(asm.JNE, R2, 0, local)  # broadcast or multicast (OTHERHOST left at the top)
    if family == 6:
        _match(a, dst, ipaddress.IPv6Address("fe80::").packed, 10, local)
    addresses = [x for x in s.local if x.version == family]
    if addresses:
        for_node = a.fresh("for_node")
        for address in addresses:
            _match(a, dst, address.packed, address.max_prefixlen, for_node)
        a.ja(forward)
        a.label(for_node)
        _socket_lookup(a, family, s.l2_len, local, forward)
    else:
        a.ja(forward)
    a.label(local)
    from_cluster = a.fresh("from_cluster")
    a.jmpi(asm.JSET, R8, SRC_INTERNAL, from_cluster)
    _count_node(a, family, "traffic=internet-in scope=host")
    a.ja(out)
    a.label(from_cluster)
    _count_node(a, family, "traffic=cluster-in scope=host")
    a.ja(out)
    # forwarded, the source side: the nft layout's forward chains (nft_layout.desired_rules) count the same
    a.label(forward)
    from_internet_done = a.fresh("from_internet_done")
    a.jmpi(asm.JSET, R8, SRC_INTERNAL, from_internet_done)
    _count_node(a, family, "traffic=internet-in scope=pod")
    a.label(from_internet_done)
    dst_internal = a.fresh("dst_internal")
    a.jmpi(asm.JSET, R8, DST_INTERNAL, dst_internal)
    _count_pod(a, s, family, src, "tx-inet")
    a.ja(out)
    a.label(dst_internal)
    _count_pod(a, s, family, src, "tx-clus", node_key="traffic=cluster-out scope=pod")
    a.ja(out)


def build(s: Spec) -> Asm:
    """The program for `s`, unassembled (map fds are given at `Asm.assemble`)."""
    a = Asm()
    a.mov(R6, R1)
    if s.direction == INGRESS:
        a.ldx(4, R2, R6, SKB_PKT_TYPE)
        a.jmpi(asm.JEQ, R2, 3, "out")  # PACKET_OTHERHOST: never delivered nor forwarded
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
