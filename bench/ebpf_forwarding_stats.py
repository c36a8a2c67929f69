"""What the eBPF layout's programs cost per run in real forwarding, timed by the kernel (BPF_ENABLE_STATS).

bench/ebpf_program_cost.py times the programs on one cache-hot packet (BPF_PROG_TEST_RUN); this one times them on
the forwarding path of the accounting tests' pod -> node -> internet namespaces while one sender pushes 64-byte UDP
datagrams (bench/netacct_forwarding.py's UDP case), with `--pods` pods in the pods map. The kernel's run-time
accounting itself costs two clock reads per run: an empty program attached on the pod's hook beside the layout's
measures that share, and the figures are given with it subtracted. A forwarded packet runs the ingress program
where it arrives (the pod's veth) and the egress program where it leaves (the uplink). Stats are enabled through
an fd (undone when it closes) only while traffic runs; they are global, so other programs on the machine are timed
meanwhile too.

    python bench/ebpf_forwarding_stats.py [--pods 0 500] [--seconds 2] [--rounds 3]     (root)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netacct_forwarding import Bench  # run as a script, bench/ is on sys.path

from agent.host import bpf, bpf_tc
from agent.netacct.ebpf import asm
from tests.netacct import netns


def attached(topo: netns.Topology) -> dict[str, int]:
    """Program name -> an fd of each program on the tcx hooks of the node's interfaces (one program serves every
    interface of a kind, and the kernel times a program, not a hook)."""
    out = {}
    for iface in bpf_tc.interfaces(topo.node):
        for attach in (bpf.TCX_INGRESS, bpf.TCX_EGRESS):
            with netns.entered(topo.node):
                progs, _ = bpf.prog_query(iface.index, attach)
            for prog_id in progs:
                fd = bpf.prog_fd_by_id(prog_id)
                name = bpf.prog_info(fd).name
                if name in out:
                    os.close(fd)
                else:
                    out[name] = fd
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[0, 500])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (bpf(2), namespaces)", file=sys.stderr)
        return 2
    topo = netns.build()
    bench = Bench(topo, [("ebpf", "nft")], args.seconds, 1)
    empty = asm.Asm()
    empty.movi(asm.R0, -1)
    empty.exit()
    baseline = bpf.prog_load(bpf.PROG_SCHED_CLS, empty.assemble({}), "gna_empty", bpf.TCX_INGRESS)
    pod_side = next(i.index for i in bpf_tc.interfaces(topo.node) if i.name == "v-node-pod")
    print(f"eBPF programs in real forwarding (64-byte UDP pod -> internet), {args.rounds} rounds x "
          f"{args.seconds:g} s, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        for pods in args.pods:
            results: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                bench.configure("ebpf", pods)
                with netns.entered(topo.node):
                    link = bpf.link_create(baseline, pod_side, bpf.TCX_INGRESS)
                progs = attached(topo)
                stats = bpf.enable_stats()
                try:
                    before = {name: bpf.prog_run_stats(fd) for name, fd in progs.items()}
                    bench.udp_kpps(args.seconds)
                    after = {name: bpf.prog_run_stats(fd) for name, fd in progs.items()}
                finally:
                    os.close(stats)
                    os.close(link)
                for name, fd in progs.items():
                    runs = after[name][1] - before[name][1]
                    if runs > 1000:
                        key = "clock" if name == "gna_empty" else "ingress" if name.startswith("gna_in") else "egress"
                        results.setdefault(key, []).append((after[name][0] - before[name][0]) / runs)
                    os.close(fd)
            clock = statistics.median(results.pop("clock"))
            print(f"  {pods} pods: timing share (empty program) {clock:.0f} ns; per run, without it:")
            for name, values in sorted(results.items()):
                print(f"    {name:<24}{statistics.median(values) - clock:>6.0f} ns   {[round(v) for v in values]}")
    finally:
        os.close(baseline)
        bench.close()
        netns.destroy(topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
