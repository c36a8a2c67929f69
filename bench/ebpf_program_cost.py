"""What the eBPF layout's programs cost per packet, measured by the kernel itself (BPF_PROG_TEST_RUN, repeat N).

The ingress program as the layout builds it (default internal CIDRs, the node's addresses compared inline, a pods
map holding `--pods` pods x 2 families x 4 roles) runs on one 64-byte packet of each kind the node sees: forwarded
internet -> pod and pod -> internet (one array + one hash lookup), pod -> pod on this node (two of each), host
input, and IPv6 forwarding; beside it an empty program (return -1) gives the harness's own share. Figures are
ns per run as the kernel reports them (median of `--rounds`), without the hook's dispatch, which
bench/netacct_forwarding.py --layout ebpf measures through real forwarding.

    python bench/ebpf_program_cost.py [--pods 500] [--repeat 200000] [--rounds 5]     (root)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import statistics
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.netacct import NetacctConfig
from agent.host import bpf
from agent.netacct.ebpf import asm, program

NODE_ADDRESSES = ["10.244.0.1", "203.0.113.1", "fd00:244::1", "2001:db8:1::1"]


def packet(src: str, dst: str) -> bytes:
    """A 64-byte (IP level) UDP packet behind a zero Ethernet header (PACKET_HOST in a test run)."""
    s, d = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    if s.version == 4:
        return bytes(12) + b"\x08\x00" + struct.pack(">BBHHHBBH4s4s", 0x45, 0, 64, 0, 0, 64, 17, 0, s.packed,
                                                       d.packed) + bytes(44)
    return bytes(12) + b"\x86\xdd" + struct.pack(">IHBB16s16s", 6 << 28, 24, 17, 64, s.packed, d.packed) + bytes(24)


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
    maps = {"node": bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, 16, program.NODE_SLOTS, name="bench_node"),
            "pods": bpf.map_create(bpf.MAP_PERCPU_HASH, 20, 16, 1 << 16, name="bench_pods",
                                   flags=bpf.F_NO_PREALLOC)}
    for i in range(args.pods):
        for family in (4, 6):
            for role in program.ROLES:
                key = program.pod_key(ipaddress.ip_address(pod_address(i, family)).packed, role)
                bpf.map_update(maps["pods"], key, bytes(16 * cpus))
    spec = program.spec(program.INGRESS, 14, (4, 6), NetacctConfig().internal_networks(),
                        [ipaddress.ip_address(a) for a in NODE_ADDRESSES])
    counting = bpf.prog_load(bpf.PROG_SCHED_CLS, program.build(spec).assemble(maps), spec.name, bpf.TCX_INGRESS)
    empty = asm.Asm()
    empty.movi(asm.R0, -1)
    empty.exit()
    baseline = bpf.prog_load(bpf.PROG_SCHED_CLS, empty.assemble({}), "gna_empty", bpf.TCX_INGRESS)
    pod4, other4, pod6 = pod_address(0, 4), pod_address(1, 4), pod_address(0, 6)
    cases = {
        "empty program (harness)": (baseline, packet("203.0.113.9", pod4)),
        "v4 internet -> pod": (counting, packet("203.0.113.9", pod4)),
        "v4 pod -> internet": (counting, packet(pod4, "203.0.113.9")),
        "v4 pod -> pod (this node)": (counting, packet(pod4, other4)),
        "v4 host input": (counting, packet("203.0.113.9", "203.0.113.1")),
        "v6 internet -> pod": (counting, packet("2001:db8:1::9", pod6)),
    }
    results: dict[str, list[int]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fd, data) in cases.items():
            results[name].append(bpf.prog_test_run(fd, data, args.repeat)[1])
    print(f"eBPF program cost: {args.pods} pods, {len(spec.internal)} internal CIDRs, "
          f"{args.repeat} runs x {args.rounds} rounds, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  {'packet':<28}{'ns/run':>8}   rounds")
    for name, values in results.items():
        print(f"  {name:<28}{statistics.median(values):>8}   {values}")
    for fd in (counting, baseline, *maps.values()):
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
