"""Bench (b): how long one netacct scrape takes at 110 and 1,000 pods, and the read paths it was chosen over.

Goal: <= 20 ms per scrape at 110 pods (the kubelet's default max-pods). Runs as root inside a throw-away network
namespace (it re-executes itself there with `ip netns exec`, so iptables runs exactly as on a node), for each
backend. Each pod has an IPv4 and an IPv6 address, so a pod is 8 counted set elements.

    python bench/netacct_scrape.py [--pods 110 1000] [--rounds 50] [--backend nft legacy]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, generate_latest

from agent.config.netacct import NetacctConfig
from agent.netacct import ipsets
from agent.netacct.backend import Host
from agent.netacct.collector import NetacctCollector
from agent.netacct.engine import Netacct
from agent.netacct.pods import Pod, make_pod

IP = shutil.which("ip") or "/usr/sbin/ip"
IPSET = shutil.which("ipset") or "/usr/sbin/ipset"


def fake_pods(count: int) -> list[Pod]:
    """`count` pods with one IPv4 and one IPv6 address each."""
    return [make_pod(f"ns-{i % 17}", f"pod-{i}", [f"10.244.{i // 250}.{i % 250 + 1}", f"fd00:244::{i + 1:x}"])
            for i in range(count)]


def timed(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median and 95th percentile wall time in ms."""
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.95) - 1]


def alternatives(names: list[str], rounds: int) -> None:
    """The read paths measured against each other (ipset members and counters only)."""
    host = Host()
    add = re.compile(r"^add (\S+) (\S+) packets (\d+) bytes (\d+)", re.MULTILINE)

    def netlink() -> object:
        return [host.dump_set(name) for name in names]

    def ipset_batch() -> object:
        out = subprocess.run([IPSET, "-"], input="".join(f"save {n}\n" for n in names), capture_output=True,
                             text=True, check=True, timeout=10).stdout
        return {(m[1], m[2]): (int(m[3]), int(m[4])) for m in add.finditer(out)}

    def pyroute2_list() -> object:
        from pyroute2 import IPSet
        out = {}
        with IPSet() as handle:
            for name in names:
                for msg in handle.list(name):
                    adt = msg.get_attr("IPSET_ATTR_ADT")
                    for data in adt.get_attrs("IPSET_ATTR_DATA") if adt else ():
                        ip = data.get_attr("IPSET_ATTR_IP_FROM")  # pyroute2 names attribute 1 so
                        address = ip.get_attr("IPSET_ATTR_IPADDR_IPV4") or ip.get_attr("IPSET_ATTR_IPADDR_IPV6")
                        out[(name, address)] = (data.get_attr("IPSET_ATTR_PACKETS"), data.get_attr("IPSET_ATTR_BYTES"))
        return out

    for label, fn in (("netlink (used)", netlink), ("`ipset -` save + parse", ipset_batch),
                      ("pyroute2 IPSet.list", pyroute2_list)):
        med, p95 = timed(fn, max(5, rounds // 5))
        print(f"    set read via {label:<24} median {med:7.2f} ms  p95 {p95:7.2f} ms")


def inner(pod_counts: list[int], rounds: int, backend: str) -> None:
    """Runs inside the namespace."""
    for count in pod_counts:
        engine = Netacct(NetacctConfig(enabled=True, backend=backend), Host())
        engine.sync(fake_pods(count))
        registry = CollectorRegistry()
        registry.register(NetacctCollector(engine))
        read = timed(engine.scrape, rounds)
        full = timed(lambda: generate_latest(registry), rounds)  # noqa: B023 (used within the iteration)
        series = generate_latest(registry).decode().count("\ngpu_node_agent_")
        print(f"  {backend:<6} {count:>5} pods ({count * 8} set elements, {series} series): "
              f"read pass median {read[0]:6.2f} ms p95 {read[1]:6.2f} ms | full scrape with exposition "
              f"median {full[0]:6.2f} ms p95 {full[1]:6.2f} ms")
        if backend == "nft":
            alternatives([ipsets.set_name(r, f) for f in (4, 6) for r in ipsets.COUNTED], rounds)
        engine.remove_all()
        engine.close()


def main() -> int:
    """Create a namespace per backend and run the measurements inside it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[110, 1000])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--backend", nargs="+", default=["nft", "legacy"], choices=["nft", "legacy"])
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.pods, args.rounds, args.backend[0])
        return 0
    if os.geteuid() != 0:
        print("needs root (ip netns, iptables, ipset)")
        return 2
    print(f"netacct scrape bench: {os.cpu_count()} CPUs, {os.uname().release}")
    for backend in args.backend:
        ns = f"gna-bench-{uuid.uuid4().hex[:6]}"
        subprocess.run([IP, "netns", "add", ns], check=True, timeout=30)
        try:
            subprocess.run([IP, "netns", "exec", ns, sys.executable, __file__, "--inner", "--rounds",
                            str(args.rounds), "--backend", backend, "--pods", *map(str, args.pods)],
                           check=True, timeout=1800)
        finally:
            subprocess.run([IP, "netns", "del", ns], check=False, timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
