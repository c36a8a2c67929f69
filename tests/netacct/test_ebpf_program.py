"""The assembler's encoding, and the counting program's decisions checked against a model of the nft layout's
rules: the program runs in the kernel (BPF_PROG_TEST_RUN) on generated packets, and the map slots it bumped must be
exactly the series the rules would count, with IP-level bytes."""

from __future__ import annotations

import ipaddress
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.host import bpf
from agent.netacct.ebpf import asm, program
from agent.netacct.ebpf.asm import Asm, AsmError, Insn

Net = ipaddress.IPv4Network | ipaddress.IPv6Network
Addr = ipaddress.IPv4Address | ipaddress.IPv6Address
SK_BUFF_SIZE = 192  # sizeof(struct __sk_buff) on 6.x: a test run's context


def test_encoding_matches_the_instruction_set_document() -> None:
    a = Asm()
    a.movi(asm.R0, -1)  # b7 00 0000 ffffffff
    a.ld_map(asm.R1, "m")  # 18 11 0000 <fd>, then a zero slot
    a.ldx(4, asm.R2, asm.R6, 76)  # 61 62 4c00 00000000
    a.jmp32i(asm.JNE, asm.R2, 0xDD86, "end")  # 56 02 <off> 86dd0000
    a.st(4, asm.FP, -4, 7)  # 62 0a fcff 07000000
    a.label("end")
    a.exit()  # 95
    code = a.assemble({"m": 9})
    assert code.hex() == ("b7000000ffffffff" "1811000009000000" "0000000000000000" "6162" "4c00" "00000000"
                          "5602" "0100" "86dd0000" "620afcff07000000" "9500000000000000")
    assert asm.decode(code)[4] == Insn(0x56, 2, 0, 1, 0xDD86)


def test_bad_programs_are_refused_before_the_kernel() -> None:
    a = Asm()
    a.ja("nowhere")
    with pytest.raises(AsmError, match="undefined label nowhere"):
        a.assemble({})
    a = Asm()
    a.ld_map(asm.R1, "pods")
    with pytest.raises(AsmError, match="no fd for map pods"):
        a.assemble({})
    a.label("x")
    with pytest.raises(AsmError, match="twice"):
        a.label("x")
    with pytest.raises(AsmError, match="32 bits"):
        Insn(0xB7, 0, 0, 0, 1 << 32).encode()


def test_keys_and_slots_round_trip() -> None:
    for address in (ipaddress.ip_address("10.244.1.2"), ipaddress.ip_address("fd00::2")):
        for role in program.ROLES:
            key = program.pod_key(address.packed, role)
            assert len(key) == program.POD_KEY_SIZE
            assert program.parse_pod_key(key) == (address.packed, role)
    assert [program.slot_key(program.node_slot(f, k)) for f in (4, 6) for k in program.NODE_KEYS] == \
        [(f, k) for f in (4, 6) for k in program.NODE_KEYS]


def test_names_follow_what_the_program_compares() -> None:
    nets = [ipaddress.ip_network("10.0.0.0/9"), ipaddress.ip_network("10.128.0.0/9")]
    one = program.spec(program.INGRESS, 14, (4, 6), nets, [ipaddress.ip_address("10.0.0.1")])
    assert one == program.spec(program.INGRESS, 14, (6, 4), [ipaddress.ip_network("10.0.0.0/8")],
                               [ipaddress.ip_address("10.0.0.1"), ipaddress.ip_address("fe80::1")])
    assert one.name != program.spec(program.INGRESS, 0, (4, 6), nets, [ipaddress.ip_address("10.0.0.1")]).name
    assert len(one.name) <= 15


# -- the program in the kernel ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def maps() -> Iterator[dict[str, int]]:
    if os.geteuid() != 0:
        pytest.skip("loading programs needs root")
    fds = {"node": bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, 16, program.NODE_SLOTS, name="t_node"),
           "pods": bpf.map_create(bpf.MAP_PERCPU_HASH, 20, 16, 64, name="t_pods", flags=bpf.F_NO_PREALLOC)}
    yield fds
    for fd in fds.values():
        os.close(fd)


def _snapshot(fds: dict[str, int]) -> dict[object, tuple[int, int]]:
    cpus = bpf.possible_cpus()

    def total(raw: bytes) -> tuple[int, int]:
        values = [struct.unpack_from("<QQ", raw, 16 * c) for c in range(cpus)]
        return sum(v[0] for v in values), sum(v[1] for v in values)

    out: dict[object, tuple[int, int]] = {}
    for key, raw in bpf.map_lookup_batch(fds["node"], 4, 16 * cpus, program.NODE_SLOTS):
        out[program.slot_key(int.from_bytes(key, "little"))] = total(raw)
    for key, raw in bpf.map_lookup_batch(fds["pods"], 20, 16 * cpus, 64):
        out[program.parse_pod_key(key)] = total(raw)
    return out


def _packet(src: Addr, dst: Addr, payload: int, proto: int) -> bytes:
    if src.version == 4:
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + payload, 0, 0, 64, proto, 0, src.packed, dst.packed)
        return bytes(12) + b"\x08\x00" + ip + bytes(payload)
    ip6 = struct.pack(">IHBB16s16s", 6 << 28, payload, proto, 64, src.packed, dst.packed)
    return bytes(12) + b"\x86\xdd" + ip6 + bytes(payload)


@dataclass(frozen=True)
class Case:
    """One packet through one hook: `forwarded` (egress only) is the ingress device the kernel recorded."""

    nets: list[Net]
    local: list[Addr]
    src: Addr
    dst: Addr
    pods: set[tuple[bytes, str]]
    direction: str
    forwarded: bool
    proto: int
    payload: int
    told: bool = False  # the spec is told the pods' addresses (it compares their shared prefix before a lookup)


def _model(case: Case) -> list[object]:
    """What the nft layout's rules count for this packet (nft_layout.desired_rules), as map keys, split as the
    program splits it: host input and a forwarded packet's source side at ingress, host output and a forwarded
    packet's destination side at egress. No socket matches a test run's packet (ports 0), so a TCP/UDP packet
    to a node address is a de-NATed one to forward, unless its ports are beyond the packet."""
    src, dst, pods = case.src, case.dst, case.pods
    family = src.version
    src_int, dst_int = any(src in n for n in case.nets), any(dst in n for n in case.nets)
    out: list[object] = []
    if case.direction == program.EGRESS and not case.forwarded:
        return [(family, f"traffic={'cluster' if dst_int else 'internet'}-out scope=host")]
    if case.direction == program.EGRESS:
        if not dst_int:
            out.append((family, "traffic=internet-out scope=pod"))
        if not src_int:
            out += [(dst.packed, "rx-inet")] if (dst.packed, "rx-inet") in pods else []
        elif (dst.packed, "rx-clus") in pods:
            out += [(dst.packed, "rx-clus"), (family, "traffic=cluster-in scope=pod")]
        return out
    link_local = family == 6 and dst in ipaddress.ip_network("fe80::/10")
    socket_checked = dst in case.local and case.proto in (6, 17) and case.payload >= 4
    if link_local or (dst in case.local and not socket_checked):
        return [(family, f"traffic={'cluster' if src_int else 'internet'}-in scope=host")]
    if not src_int:
        out.append((family, "traffic=internet-in scope=pod"))
    if not dst_int:
        out += [(src.packed, "tx-inet")] if (src.packed, "tx-inet") in pods else []
    elif (src.packed, "tx-clus") in pods:
        out += [(src.packed, "tx-clus"), (family, "traffic=cluster-out scope=pod")]
    return out


@st.composite
def cases(draw: st.DrawFn) -> Case:
    family = draw(st.sampled_from([4, 6]))
    bits = 32 if family == 4 else 128
    make_addr = ipaddress.IPv4Address if family == 4 else ipaddress.IPv6Address
    nets: list[Net] = [ipaddress.ip_network((draw(st.integers(0, 2**bits - 1)), draw(st.integers(0, bits))),
                                            strict=False) for _ in range(draw(st.integers(0, 3)))]

    def address() -> Addr:
        near: bool = draw(st.booleans())
        if nets and near:  # inside a net, or just outside its boundary
            net = draw(st.sampled_from(nets))
            offset = draw(st.sampled_from([0, net.num_addresses - 1, net.num_addresses, -1]))
            return make_addr((int(net.network_address) + offset) % 2**bits)
        return make_addr(draw(st.integers(0, 2**bits - 1)))

    src, dst = address(), address()
    local = [dst] if draw(st.integers(0, 3)) == 0 else [address()]
    pods = {(a.packed, role) for a in (src, dst) if draw(st.booleans()) for role in program.ROLES}
    direction = draw(st.sampled_from([program.INGRESS, program.EGRESS]))
    return Case(nets, local, src, dst, pods, direction, draw(st.booleans()), draw(st.sampled_from([1, 6, 17])),
                draw(st.integers(0, 1400)), draw(st.booleans()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_the_program_counts_what_the_rules_count(maps: dict[str, int], case: Case) -> None:
    for key in bpf.map_keys(maps["pods"], 20):
        bpf.map_delete(maps["pods"], key)
    for address, role in case.pods:
        bpf.map_update(maps["pods"], program.pod_key(address, role), bytes(16 * bpf.possible_cpus()))
    told = [ipaddress.ip_address(a) for a, _ in case.pods] if case.told else None
    s = program.spec(case.direction, 14, (4, 6), case.nets, case.local, pods=told)
    prog = bpf.prog_load(bpf.PROG_SCHED_CLS, program.build(s).assemble(maps), s.name,
                         bpf.TCX_INGRESS if case.direction == program.INGRESS else bpf.TCX_EGRESS)
    ctx = bytearray(SK_BUFF_SIZE)
    struct.pack_into("<I", ctx, program.SKB_INGRESS_IFINDEX, 7 if case.forwarded else 0)
    try:
        before = _snapshot(maps)
        packet = _packet(case.src, case.dst, case.payload, case.proto)
        assert bpf.prog_test_run(prog, packet, ctx=bytes(ctx))[0] == program.RETURN_NEXT
        after = _snapshot(maps)
    finally:
        os.close(prog)
    bumped = {k: (after[k][0] - before.get(k, (0, 0))[0], after[k][1] - before.get(k, (0, 0))[1])
              for k in after if after[k] != before.get(k, (0, 0))}
    assert bumped == {k: (1, len(packet) - 14) for k in _model(case)}


def test_a_forwarded_packet_looks_up_only_addresses_that_can_be_a_pods(maps: dict[str, int]) -> None:
    """An address outside the prefix the pods share is not looked up (one hash lookup per forwarded packet, not
    two): an entry planted for the internet side stays at zero while the pod's own entries count."""
    for key in bpf.map_keys(maps["pods"], 20):
        bpf.map_delete(maps["pods"], key)
    pods = [ipaddress.ip_address("10.245.0.2"), ipaddress.ip_address("10.245.1.200")]
    peer = ipaddress.ip_address("203.0.113.9")
    for address in (*pods, peer):
        for role in program.ROLES:
            bpf.map_update(maps["pods"], program.pod_key(address.packed, role), bytes(16 * bpf.possible_cpus()))
    assert program.pod_prefixes(pods, (4, 6)) == (ipaddress.ip_network("10.245.0.0/23"),)
    assert program.pod_prefixes([ipaddress.ip_address("::"), ipaddress.ip_address("ffff::")], (4, 6)) == \
        (ipaddress.ip_network("::/0"),)  # an IPv6 /0, not 0.0.0.0/0: the family's lookups stay in the program
    assert program.pod_prefixes([ipaddress.ip_address("10.244.1.2")], (4,)) == (ipaddress.ip_network("10.244.1.0/24"),)
    nets = [ipaddress.ip_network("10.0.0.0/8")]
    ctx = bytearray(SK_BUFF_SIZE)
    struct.pack_into("<I", ctx, program.SKB_INGRESS_IFINDEX, 7)
    progs = []
    for direction, attach in ((program.INGRESS, bpf.TCX_INGRESS), (program.EGRESS, bpf.TCX_EGRESS)):
        s = program.spec(direction, 14, (4, 6), nets, (), pods=pods)
        progs.append((bpf.prog_load(bpf.PROG_SCHED_CLS, program.build(s).assemble(maps), s.name, attach),
                      bytes(ctx) if direction == program.EGRESS else None))
    try:
        before = _snapshot(maps)
        for src, dst in ((pods[0], peer), (peer, pods[1])):
            for prog, run_ctx in progs:
                bpf.prog_test_run(prog, _packet(src, dst, 36, 17), ctx=run_ctx)
        after = _snapshot(maps)
    finally:
        for prog, _ in progs:
            os.close(prog)
    bumped = {k: after[k][0] - before.get(k, (0, 0))[0] for k in after if after[k] != before.get(k, (0, 0))}
    assert bumped == {(pods[0].packed, "tx-inet"): 1, (pods[1].packed, "rx-inet"): 1,
                      (4, "traffic=internet-out scope=pod"): 1, (4, "traffic=internet-in scope=pod"): 1}
