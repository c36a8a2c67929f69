"""Bench (a): forwarding throughput through the node namespace with no accounting, and 0, 100 and 500 pods accounted.

Goal (issue 32): 500 pods accounted >= 0.95 x no accounting at all (`none`), on the default layout (auto: the
native nftables table where it works). The iptables layout (constant mangle rules + ipset counters, `--layout
iptables`) is also compared against the naive layout of one rule per pod and direction/class (4 per pod in one
chain, every forwarded packet walks all of them). Measured through the same pod -> node -> internet namespaces
as the end-to-end tests:

- TCP: one stream, pod -> internet peer, Gbit/s (veth offloads on, as on a node);
- UDP: 64-byte datagrams from one Python sender, forwarded packets/s counted by the node (`ForwDatagrams`);
  small packets make the per-packet rule cost visible.

All layouts named run in one topology against one `none`: their configurations are interleaved round by round
in a shuffled order; in each round a configuration runs `--batches` short batches and the fastest counts (other
work on a shared VM only ever slows a batch), and the median of the rounds is reported.

    python bench/netacct_forwarding.py [--seconds 2] [--rounds 5] [--batches 4]
                                       [--layout auto ebpf nft iptables] [--backend nft legacy]

The `+ns/pkt` column is the time each configuration adds per forwarded 64-byte packet (1/rate against none): the
eBPF layout's goals (issue 40) are 500 pods >= 0.97 of none, TCP and UDP-64, and at most 0.4 of the time the nft
layout adds (run `--layout ebpf nft` for the share).
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.netacct import NetacctConfig
from agent.host import bpf
from agent.host.netfilter import Host
from agent.netacct.engine import Netacct
from agent.pods.model import Pod, make_pod
from tests.netacct import netns
from tests.netacct.netns import INET4, POD4, POD6

CONFIGS = [("none", 0), ("netacct", 0), ("netacct", 100), ("netacct", 500)]
NAIVE_CONFIGS = [("naive", 100), ("naive", 500)]  # iptables layout only: it reuses that layout's internal ipset
NAIVE = "GNA-BENCH-NAIVE"


SPREAD = {"spread": False}  # --spread-pods


def pods(count: int) -> list[Pod]:
    """The sending pod plus `count - 1` others, from the sender's pod CIDR as a node's pods are (the eBPF layout
    counts them through its index: one /16 and /112); with --spread-pods from another /16 (its hash mode)."""
    def address(i: int) -> list[str]:
        if SPREAD["spread"]:
            return [f"10.245.{i // 250}.{i % 250 + 1}", f"fd00:245::{i + 1:x}"]
        return [f"10.244.{2 + i // 250}.{i % 250 + 1}", f"fd00:244:1::{i + 3:x}"]
    others = [make_pod("bench", f"pod-{i}", address(i)) for i in range(max(0, count - 1))]
    return [make_pod("bench", "sender", [POD4, POD6]), *others] if count else []


def naive_payload(count: int) -> str:
    """One chain, four counting rules per pod (IPv4), jumped to from FORWARD."""
    lines = ["*mangle", f":{NAIVE} - [0:0]", f"-I FORWARD 1 -j {NAIVE}"]
    for pod in pods(count):
        ip = pod.ips[0]
        for match, tag in ((f"-s {ip} -m set ! --match-set gna-internal4 dst", "tx-inet"),
                           (f"-d {ip} -m set ! --match-set gna-internal4 src", "rx-inet"),
                           (f"-s {ip} -m set --match-set gna-internal4 dst", "tx-clus"),
                           (f"-d {ip} -m set --match-set gna-internal4 src", "rx-clus")):
            lines.append(f'-A {NAIVE} {match} -m comment --comment "bench pod={pod.name} {tag}"')
    return "\n".join([*lines, "COMMIT", ""])


class Bench:
    """Switches the node between configurations and measures traffic through it."""

    def __init__(self, topo: netns.Topology, layouts: list[tuple[str, str]], seconds: float, batches: int) -> None:
        self.topo = topo
        self.seconds = seconds
        self.batches = batches
        self.host = Host(netns=topo.node)
        # the eBPF layout's pins on a bpffs of the bench's own (pins name interfaces by index: never share one)
        self.bpffs = tempfile.mkdtemp(prefix="gna-bench-bpffs-")
        bpf.mount_bpffs(self.bpffs)
        self.engines: dict[str, Netacct] = {}
        self.modes: dict[str, str] = {}
        for layout, mode in layouts:
            engine = Netacct(NetacctConfig(enabled=True, layout=layout, backend=mode, bpffs_dir=self.bpffs),
                             self.host)
            chosen = engine.layout  # auto: probed here, in the node namespace
            name = chosen + (f"-{mode}" if chosen == "iptables" else "") + (" [auto]" if layout == "auto" else "")
            if any(n.split(" ")[0] == name.split(" ")[0] for n in self.engines):
                engine.close()  # auto chose a layout also asked for by name: measure it once
                continue
            self.engines[name] = engine
            self.modes[name] = mode

    def close(self) -> None:
        """Close the engines and unmount the bench's bpffs."""
        for engine in self.engines.values():
            engine.close()
        netns.sh("umount", self.bpffs, check=False)
        os.rmdir(self.bpffs)

    def configure(self, kind: str, count: int) -> None:
        """Remove everything, then install one configuration: `none`, a layout's name, or `naive` (its iptables
        rules beside the first iptables layout's internal ipset)."""
        for name, engine in self.engines.items():
            mode = self.modes[name]
            if name.startswith("iptables"):
                save = self.host.save(mode, 4, counters=False)
                if f":{NAIVE} " in save:
                    self.host.restore(mode, 4, f"*mangle\n-D FORWARD -j {NAIVE}\n:{NAIVE} - [0:0]\n-X {NAIVE}\n"
                                               "COMMIT\n")
            engine.remove_all()
        if kind in self.engines:
            self.engines[kind].sync(pods(count))
        elif kind == "naive":
            name = next(n for n in self.engines if n.startswith("iptables"))
            self.engines[name].sync([])
            self.host.restore(self.modes[name], 4, naive_payload(count))

    def best(self, measure: Callable[[float], float]) -> float:
        """The best of `batches` short batches: interference from other work on a shared VM only ever slows a
        batch, so the fastest one is the closest to the configuration's own cost."""
        return max(measure(self.seconds / self.batches) for _ in range(self.batches))

    def tcp_gbits(self, seconds: float) -> float:
        """One TCP stream pod -> internet for `seconds`; Gbit/s received."""
        with netns.entered(self.topo.inet):
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with netns.entered(self.topo.pod):
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind((INET4, 0))
        server.listen(1)
        received = [0]

        def sink() -> None:
            conn, _ = server.accept()
            buf = bytearray(1 << 20)
            with conn:
                while n := conn.recv_into(buf):
                    received[0] += n

        thread = threading.Thread(target=sink)
        thread.start()
        client.connect((INET4, server.getsockname()[1]))
        payload = b"\x5a" * (256 << 10)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            client.sendall(payload)
        client.close()
        thread.join()
        elapsed = time.perf_counter() - start
        server.close()
        return received[0] * 8 / elapsed / 1e9

    def _forwarded(self) -> int:
        with netns.entered(self.topo.node), open("/proc/thread-self/net/snmp", encoding="ascii") as handle:
            head, values = [line.split() for line in handle.readlines()[:2]]
        return int(values[head.index("ForwDatagrams")])

    def udp_kpps(self, seconds: float) -> float:
        """64-byte datagrams pod -> internet for `seconds`; thousands of packets/s the node forwarded."""
        with netns.entered(self.topo.inet):
            sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with netns.entered(self.topo.pod):
            sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sink.bind((INET4, 0))  # bound but never read: overflow is dropped silently, no ICMP back
        target, payload = (INET4, sink.getsockname()[1]), b"\x5a" * 64
        before = self._forwarded()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(1000):
                sender.sendto(payload, target)
        elapsed = time.perf_counter() - start
        forwarded = self._forwarded() - before
        sender.close()
        sink.close()
        return forwarded / elapsed / 1e3


def run(layouts: list[tuple[str, str]], seconds: float, rounds: int, batches: int) -> None:
    """All configurations of every layout, interleaved in one topology against one `none`."""
    topo = netns.build()
    bench = Bench(topo, layouts, seconds, batches)
    configs = [("none", 0)]
    for name in bench.engines:
        configs += [(name, 0), (name, 100), (name, 500)]
    if any(name.startswith("iptables") for name in bench.engines):
        configs += NAIVE_CONFIGS
    tcp: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    udp: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    try:
        order = random.Random(7)
        for _ in range(rounds):
            for config in order.sample(configs, len(configs)):  # no configuration always runs first or last
                bench.configure(*config)
                tcp[config].append(bench.best(bench.tcp_gbits))
                udp[config].append(bench.best(bench.udp_kpps))
        bench.configure("none", 0)
    finally:
        bench.close()
        netns.destroy(topo)
    none_tcp, none_udp = statistics.median(tcp[("none", 0)]), statistics.median(udp[("none", 0)])
    print(f"\nmedian of {rounds} rounds, each the best of {batches} batches x {seconds / batches:g} s; ratios "
          f"against no accounting (none) and against the same layout with 0 pods")
    print(f"  {'config':<22}{'pods':>5}  {'TCP Gbit/s':>10} {'/none':>6} {'/0pods':>6}   {'UDP-64 kpps':>11} "
          f"{'/none':>6} {'/0pods':>6} {'+ns/pkt':>8}")
    added: dict[tuple[str, int], float] = {}
    for config in configs:
        base = (config[0], 0) if config[0] in bench.engines else ("none", 0)
        t, u = statistics.median(tcp[config]), statistics.median(udp[config])
        base_tcp, base_udp = statistics.median(tcp[base]), statistics.median(udp[base])
        # the sender's thread runs the veth receive and the forward path: 1/rate is its time per packet
        added[config] = 1e6 / u - 1e6 / none_udp
        print(f"  {config[0]:<22}{config[1]:>5}  {t:>10.2f} {t / none_tcp:>6.2f} {t / base_tcp:>6.2f}   "
              f"{u:>11.1f} {u / none_udp:>6.2f} {u / base_udp:>6.2f} {added[config]:>8.0f}")
    for name in bench.engines:
        goal_tcp = statistics.median(tcp[(name, 500)]) / none_tcp
        goal_udp = statistics.median(udp[(name, 500)]) / none_udp
        floor = 0.97 if name.startswith("ebpf") else 0.95  # issue 40's goal for eBPF, issue 32's for the others
        verdict = "met" if min(goal_tcp, goal_udp) >= floor else "NOT met"
        print(f"  {name}: 500 pods >= {floor} x none: TCP {goal_tcp:.3f}, UDP-64 {goal_udp:.3f} -> {verdict}")
    ebpf = next((n for n in bench.engines if n.startswith("ebpf")), None)
    nft = next((n for n in bench.engines if n.startswith("nft")), None)
    if ebpf and nft and added[(nft, 500)] > 0:
        share = added[(ebpf, 500)] / added[(nft, 500)]
        print(f"  ebpf adds {share:.2f} of the time nft adds per 64-byte packet (500 pods; goal <= 0.4) -> "
              f"{'met' if share <= 0.4 else 'NOT met'}")
    print(f"  load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> int:
    """Parse arguments and run each backend."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4,
                        help="short batches per configuration and round; the best one counts")
    parser.add_argument("--layout", nargs="+", default=["auto"], choices=["auto", "ebpf", "nft", "iptables"])
    parser.add_argument("--backend", nargs="+", default=["nft"], choices=["nft", "legacy"],
                        help="iptables backends to run the iptables layout on")
    parser.add_argument("--spread-pods", action="store_true",
                        help="the other pods in another /16 than the sender (the eBPF layout's hash mode)")
    args = parser.parse_args()
    SPREAD["spread"] = args.spread_pods
    reason = netns.missing_prerequisite()
    if reason:
        print(reason)
        return 2
    print(f"netacct forwarding bench: {os.cpu_count()} CPUs, {os.uname().release}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"pods {'spread over two /16s' if args.spread_pods else 'in the sender pod CIDR'}")
    layouts = [(layout, mode) for layout in args.layout
               for mode in (args.backend if layout == "iptables" else args.backend[:1])]
    run(layouts, args.seconds, args.rounds, args.batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
