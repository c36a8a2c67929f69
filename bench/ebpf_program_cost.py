"""What the eBPF layout's programs cost per packet, measured by the kernel itself (BPF_PROG_TEST_RUN, repeat N).

The programs as the layout builds them (default internal CIDRs, the node's addresses and the prefix the pods
share compared inline, a pods map holding `--pods` pods x 2 families x 4 roles, and each pod a slot), in both pod
modes (hash: a pod's counters found by a hash lookup; index: through the inlined index and slot arrays, slots.py),
run on one 64-byte packet of each
kind the node sees. A forwarded packet runs the ingress program where it arrives (source side) and the egress
program where it leaves (destination side, `ingress_ifindex` set as the kernel sets it): both are timed and
summed. Host input to a UDP socket (one socket lookup) and an empty program (return -1: the harness's own share)
are beside them. Figures are ns per run as the kernel reports them (median of `--rounds`), on a cache-hot packet
and without the hooks' dispatch: bench/ebpf_forwarding_stats.py times the programs in real forwarding, and
bench/netacct_forwarding.py --layout ebpf measures the whole.

    python bench/ebpf_program_cost.py [--pods 500] [--repeat 200000] [--rounds 5]     (root)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import statistics
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.netacct import NetacctConfig
from agent.host import bpf
from agent.netacct.ebpf import asm, program, slots
from agent.netacct.ebpf.objects import SHAPES

NODE_ADDRESSES = ["10.244.0.1", "203.0.113.1", "fd00:244::1", "2001:db8:1::1"]


def packet(src: str, dst: str, port: int = 0) -> bytes:
    """A 64-byte (IP level) UDP packet to `port` behind a zero Ethernet header (PACKET_HOST in a test run)."""
    s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    ports = struct.pack(">HH", 40000, port)
    if s.version == 4:
        return bytes(12) + b"\x08\x00" + struct.pack(">BBHHHBBH4s4s", 0x45, 0, 64, 0, 0, 64, 17, 0, s.packed,
                                                       d.packed) + ports + bytes(40)
    return (bytes(12) + b"\x86\xdd" + struct.pack(">IHBB16s16s", 6 << 28, 24, 17, 64, s.packed, d.packed) + ports
            + bytes(20))


def forwarded_ctx() -> bytes:
    """A test run's __sk_buff with an ingress device, as a forwarded packet has at egress."""
    ctx = bytearray(192)
    struct.pack_into("<I", ctx, program.SKB_INGRESS_IFINDEX, 2)
    return bytes(ctx)


def pod_address(i: int, family: int) -> str:
    """The i-th pod's address."""
    return f"10.244.{1 + i // 250}.{i % 250 + 2}" if family == 4 else f"fd00:244:1::{i + 2:x}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (bpf(2))", file=sys.stderr)
        return 2
    cpus = bpf.possible_cpus()
    maps = {name: bpf.map_create(kind, key, value, entries, name=f"bench_{name}", flags=flags)
            for name, (kind, key, value, entries, flags) in SHAPES.items()}  # the layout's maps
    addresses = [ipaddress.ip_address(pod_address(i, family)) for i in range(args.pods) for family in (4, 6)]
    table = slots.Slots(maps, cpus)
    table.set_addresses(a.packed for a in addresses)
    for i in range(args.pods):
        for family in (4, 6):
            for role in program.ROLES:
                key = program.pod_key(ipaddress.ip_address(pod_address(i, family)).packed, role)
                bpf.map_update(maps["pods"], key, bytes(16 * cpus))
    local = [ipaddress.ip_address(a) for a in NODE_ADDRESSES]
    modes = {"hash": None, "index": table.modes(a.packed for a in addresses)}
    progs = {}
    for mode, index in modes.items():
        for direction, attach in ((program.INGRESS, bpf.TCX_INGRESS), (program.EGRESS, bpf.TCX_EGRESS)):
            spec = program.spec(direction, 14, (4, 6), NetacctConfig().internal_networks(), local, pods=addresses,
                                index=index)
            progs[(mode, direction)] = bpf.prog_load(bpf.PROG_SCHED_CLS, program.build(spec).assemble(maps),
                                                     spec.name, attach)
    empty = asm.Asm()
    empty.movi(asm.R0, -1)
    empty.exit()
    baseline = bpf.prog_load(bpf.PROG_SCHED_CLS, empty.assemble({}), "gna_empty", bpf.TCX_INGRESS)
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("0.0.0.0", 0))  # noqa: S104 -- the lookup must find it for a node address; it never reads
    port = listener.getsockname()[1]
    pod4, other4, pod6 = pod_address(0, 4), pod_address(1, 4), pod_address(0, 6)
    fwd = forwarded_ctx()
    results: dict[str, dict[str, list[int]]] = {}
    for mode in modes:
        ing, eg = progs[(mode, program.INGRESS)], progs[(mode, program.EGRESS)]
        cases: dict[str, list[tuple[int, bytes, bytes | None]]] = {
        "empty program (harness)": [(baseline, packet("203.0.113.9", pod4), None)],
        "v4 internet -> pod": [(ing, packet("203.0.113.9", pod4), None), (eg, packet("203.0.113.9", pod4), fwd)],
        "v4 pod -> internet": [(ing, packet(pod4, "203.0.113.9"), None), (eg, packet(pod4, "203.0.113.9"), fwd)],
        "v4 pod -> pod (this node)": [(ing, packet(pod4, other4), None), (eg, packet(pod4, other4), fwd)],
        "v6 internet -> pod": [(ing, packet("2001:db8:1::9", pod6), None),
                               (eg, packet("2001:db8:1::9", pod6), fwd)],
        "v4 host input (UDP socket)": [(ing, packet("203.0.113.9", "203.0.113.1", port), None)],
        "v4 host output": [(eg, packet("203.0.113.1", "203.0.113.9"), None)],
        }
        results[mode] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, runs in cases.items():
                results[mode][name].append(sum(bpf.prog_test_run(fd, data, args.repeat, ctx)[1]
                                               for fd, data, ctx in runs))
    print(f"eBPF program cost: {args.pods} pods, {len(spec.internal)} internal CIDRs, "
          f"{args.repeat} runs x {args.rounds} rounds, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  {'packet (ingress + egress)':<28}{'hash ns':>8}{'index ns':>9}   rounds (hash | index)")
    for name in results["hash"]:
        hashed, indexed = results["hash"][name], results["index"][name]
        print(f"  {name:<28}{statistics.median(hashed):>8}{statistics.median(indexed):>9}   {hashed} | {indexed}")
    listener.close()
    for fd in (*progs.values(), baseline, *maps.values()):
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
