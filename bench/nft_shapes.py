"""What single nftables shapes cost 64-byte UDP forwarding here: the floor under netacct's native layout.

Each shape is one table with one forward base chain at netacct's priority, installed alone in the node namespace
of the accounting tests' pod -> node -> internet topology (tests/netacct/netns.py); the rate is the node's
forwarded datagrams/s from one sender, shapes interleaved in a shuffled order round by round, medians reported
against no table at all. It answers "how close to no accounting can any per-pod counting get": a counted set
lookup (one per forwarded packet is the least per-pod accounting needs) against an empty chain, a named
counter, two interval-set lookups and prefix compares (how the layout tells cluster from internet).

The eBPF shapes (issue 40) sit beside them: the tcx hook with an empty program, one per-CPU hash lookup, and the
eBPF layout's own programs (`EbpfShapes`).

    python bench/nft_shapes.py [--seconds 2] [--rounds 4] [--batches 4]      (root; nft and ip netns)
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netacct_forwarding import Bench  # run as a script, bench/ is on sys.path

from agent.config.netacct import NetacctConfig
from agent.config.pods import DEFAULT_INTERNAL_CIDRS
from agent.host import bpf, bpf_tc
from agent.netacct.ebpf import asm, program
from agent.netacct.ebpf.objects import Objects
from agent.netacct.nft_layout import PRIORITY
from tests.netacct import netns
from tests.netacct.netns import POD4

HOOK = f"type filter hook forward priority {PRIORITY}; policy accept;"
CIDRS4 = [c for c in DEFAULT_INTERNAL_CIDRS if ":" not in c]


def table(*body: str) -> str:
    """One `inet` table holding `body`."""
    return "table inet shapes {\n" + "\n".join(body) + "\n}\n"


def chain(*rules: str) -> str:
    """The forward base chain with `rules`."""
    return "chain forward_shape {\n" + "\n".join([HOOK, *rules]) + "\n}"


SHAPES: dict[str, str | None] = {
    "none": None,
    "empty chain": table(chain()),
    "named counter": table("counter c { }", chain("counter name c")),
    "counted set lookup": table(f"set pods {{ type ipv4_addr; counter; elements = {{ {POD4} }} }}",
                                chain("ip saddr @pods")),
    "2 interval lookups": table(f"set internal {{ type ipv4_addr; flags interval; elements = {{ "
                                f"{', '.join(CIDRS4)} }} }}", chain("ip saddr @internal ip daddr @internal")),
    "2 prefix compares": table(chain(f"ip saddr {CIDRS4[0]} ip daddr {CIDRS4[0]}")),
    f"{len(CIDRS4)} prefix compares": table(chain(*(f"ip daddr {c} counter" for c in CIDRS4))),
}


class EbpfShapes:
    """The eBPF shapes: one tcx program on the forward path's ingress (the pod's veth on the node), alone in the
    namespace like the nft shapes. "tcx hook, empty program" is the hook's own cost; "tcx every hook, empty
    programs" the cost of the layout's hooks (ingress and egress on every interface) without their work; "tcx +
    per-CPU hash lookup" one lookup of the source address in a 500-pod map (what counting a pod side costs), "tcx +
    index + per-CPU array" the same count through an address index and a per-CPU array (lookups the verifier inlines);
    "ebpf layout, N pods" the layout's own ingress and egress programs on every interface, N pods in its map (from
    the node's pod CIDR: the index mode; "spread": over two /16s, the hash mode)."""

    NAMES = ("tcx hook, empty program", "tcx every hook, empty programs", "tcx + per-CPU hash lookup",
             "tcx + index + per-CPU array", "ebpf layout, 0 pods", "ebpf layout, 500 pods",
             "ebpf layout, 500 pods spread")

    def __init__(self, topo: netns.Topology) -> None:
        self.topo = topo
        self.links: list[int] = []
        self.cpus = bpf.possible_cpus()
        self.maps = {"node": bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, 16, program.NODE_SLOTS, name="shape_node"),
                     "pods": bpf.map_create(bpf.MAP_PERCPU_HASH, 20, 16, 4096, name="shape_pods",
                                            flags=bpf.F_NO_PREALLOC)}
        self.addresses = [ipaddress.ip_address(POD4).packed] + [bytes([10, 244, 2 + i // 250, i % 250 + 1])
                                                               for i in range(1, 500)]  # the node's pod CIDR
        self.spread = [ipaddress.ip_address(POD4).packed] + [bytes([10, 245, i // 250, i % 250 + 1])
                                                            for i in range(1, 500)]  # two /16s: hash mode
        for address in self.addresses:
            bpf.map_update(self.maps["pods"], program.pod_key(address, "tx-inet"), bytes(16 * self.cpus))
        # an address index (slot + 1 by the address's low 16 bits) and per-CPU counters by slot and role: two
        # lookups the verifier inlines, where a hash lookup is a helper call
        self.maps["index"] = bpf.map_create(bpf.MAP_ARRAY, 4, 4, 1 << 16, name="shape_index")
        self.maps["slots"] = bpf.map_create(bpf.MAP_PERCPU_ARRAY, 4, 16, 4 * 512, name="shape_slots")
        for slot, address in enumerate(self.addresses):
            bpf.map_update(self.maps["index"], int.from_bytes(address[2:], "big").to_bytes(4, "little"),
                           (slot + 1).to_bytes(4, "little"))
        self.bpffs = tempfile.mkdtemp(prefix="gna-shapes-bpffs-")
        bpf.mount_bpffs(self.bpffs)
        self.layout = Objects(self.bpffs, netns=topo.node)

    @staticmethod
    def _source_address(a: asm.Asm) -> None:
        """R6 = ctx, R7 = packet data, out when shorter than Ethernet + IPv4 headers."""
        a.mov(asm.R6, asm.R1)
        a.ldx(4, asm.R7, asm.R6, program.SKB_DATA)
        a.ldx(4, asm.R3, asm.R6, program.SKB_DATA_END)
        a.mov(asm.R2, asm.R7)
        a.alui(asm.ADD, asm.R2, 34)
        a.jmp(asm.JGT, asm.R2, asm.R3, "out")

    @staticmethod
    def _lookup(a: asm.Asm, name: str, key_at: int) -> None:
        """R0 = the `name` map's value for the key at FP+key_at; out when missing."""
        a.ld_map(asm.R1, name)
        a.mov(asm.R2, asm.FP)
        a.alui(asm.ADD, asm.R2, key_at)
        a.call(asm.MAP_LOOKUP_ELEM)
        a.jmpi(asm.JEQ, asm.R0, 0, "out")

    def _program(self, lookup: bool, attach: int = bpf.TCX_INGRESS, indexed: bool = False) -> int:
        a = asm.Asm()
        if indexed:  # the source address's low 16 bits (packet offsets 28, 29) index the slot; role tx-inet = 0
            self._source_address(a)
            a.ldx(1, asm.R1, asm.R7, 28)
            a.alui(asm.LSH, asm.R1, 8)
            a.ldx(1, asm.R2, asm.R7, 29)
            a.alu(asm.OR, asm.R1, asm.R2)
            a.stx(4, asm.FP, -4, asm.R1)
            self._lookup(a, "index", -4)
            a.ldx(4, asm.R1, asm.R0, 0)
            a.jmpi(asm.JEQ, asm.R1, 0, "out")
            a.alui(asm.ADD, asm.R1, -1)
            a.alui(asm.LSH, asm.R1, 2)
            a.stx(4, asm.FP, -8, asm.R1)
            self._lookup(a, "slots", -8)
        elif lookup:  # key: the IPv4 source address (packet offset 26) and role tx-inet, as the layout builds it
            self._source_address(a)
            a.ldx(4, asm.R1, asm.R7, 26)
            a.stx(4, asm.FP, -24, asm.R1)
            for off in (-20, -16, -12, -8):
                a.st(4, asm.FP, off, 0)
            self._lookup(a, "pods", -24)
        if indexed or lookup:
            a.ldx(8, asm.R1, asm.R0, 0)
            a.alui(asm.ADD, asm.R1, 1)
            a.stx(8, asm.R0, 0, asm.R1)
        a.label("out")
        a.movi(asm.R0, -1)
        a.exit()
        return bpf.prog_load(bpf.PROG_SCHED_CLS, a.assemble(self.maps), "gna_shape", attach)

    def apply(self, name: str) -> None:
        """Take every shape off, then put `name` on (a name not of these shapes: nothing)."""
        for fd in self.links:
            os.close(fd)  # unpinned links detach with their last fd
        self.links.clear()
        self.layout.remove()
        if name.startswith("ebpf layout"):
            self.layout.open_maps(create=True)
            count = 0 if name == "ebpf layout, 0 pods" else 500
            addresses = self.spread if name.endswith("spread") else self.addresses
            self.layout.set_pods({(address, role): None for address in addresses[:count] for role in program.ROLES})
            self.layout.sync_hooks((4, 6), NetacctConfig().internal_networks())
        elif name == "tcx every hook, empty programs":  # the layout's hooks: ingress and egress, every interface
            for attach in (bpf.TCX_INGRESS, bpf.TCX_EGRESS):
                prog = self._program(lookup=False, attach=attach)
                for iface in bpf_tc.interfaces(self.topo.node):
                    with netns.entered(self.topo.node):
                        self.links.append(bpf.link_create(prog, iface.index, attach))
                os.close(prog)
        elif name in self.NAMES:
            prog = self._program(lookup=name != "tcx hook, empty program", indexed="index" in name)
            ifindex = next(i.index for i in bpf_tc.interfaces(self.topo.node) if i.name == "v-node-pod")
            with netns.entered(self.topo.node):
                self.links.append(bpf.link_create(prog, ifindex, bpf.TCX_INGRESS))
            os.close(prog)

    def close(self) -> None:
        """Everything off, maps closed, the bpffs unmounted."""
        self.apply("")
        self.layout.close()
        for fd in self.maps.values():
            os.close(fd)
        netns.sh("umount", self.bpffs, check=False)
        os.rmdir(self.bpffs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4,
                        help="short batches per shape and round; the best one counts")
    args = parser.parse_args()
    topo = netns.build()
    bench = Bench(topo, [("nft", "nft")], args.seconds, args.batches)
    ebpf = EbpfShapes(topo)
    rates: dict[str, list[float]] = {name: [] for name in [*SHAPES, *EbpfShapes.NAMES]}
    print(f"nft shapes: best of {args.batches} batches in {args.seconds:g} s x {args.rounds} rounds, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        order = random.Random(11)
        for _ in range(args.rounds):
            for name in order.sample(list(rates), len(rates)):
                netns.sh("nft", "flush", "ruleset", ns=topo.node)
                ebpf.apply(name)
                payload = SHAPES.get(name)
                if payload:
                    netns.sh("nft", "-f", "-", ns=topo.node, stdin=payload)
                rates[name].append(bench.best(bench.udp_kpps))
    finally:
        ebpf.close()
        bench.close()
        netns.destroy(topo)
    base = statistics.median(rates["none"])
    print(f"  {'shape':<32}{'UDP-64 kpps':>12} {'/none':>6} {'+ns/pkt':>8}   rounds")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<32}{median:>12.1f} {median / base:>6.2f} {1e6 / median - 1e6 / base:>8.0f}   "
              f"{' '.join(f'{v:.0f}' for v in values)}")
    print(f"  load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
