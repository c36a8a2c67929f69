"""Bench (b): how long one netacct scrape takes at 110 and 1,000 pods, and the read paths it was chosen over.

Goals: <= 20 ms per scrape at 110 pods (the kubelet's default max-pods); issue 32: <= 10 ms at 110 and <= 40 ms
at 1,000 pods. Runs as root inside a throw-away network namespace (it re-executes itself there with `ip netns
exec`, so nft and iptables run exactly as on a node), for the native nftables layout and for the iptables layout
on each backend. Each pod has an IPv4 and an IPv6 address, so a pod is 8 counted set elements. For the native
layout it also times the read paths the nfnetlink reader was chosen over: `nft -j list table` (a fork) and
libnftables' JSON output in-process (ctypes, libnftables.so.1).

    python bench/netacct_scrape.py [--pods 110 1000] [--rounds 50] [--layout ebpf nft iptables] [--backend nft legacy]

The eBPF layout (issue 40: <= 5 ms at 110 pods, <= 20 ms at 1,000) reads its two pinned per-CPU maps with one
batch lookup each; inside `ip netns exec` its bpffs is mounted on that command's private /sys/fs/bpf.
"""

from __future__ import annotations

import argparse
import ctypes
import json
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
from agent.host.netfilter import Host
from agent.netacct import ipsets, nft_layout
from agent.netacct.collector import NetacctCollector
from agent.netacct.engine import Netacct
from agent.pods.model import Pod, make_pod

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


def nft_alternatives(rounds: int) -> None:
    """The native layout's read paths: every named counter and set element, as the scrape needs them."""
    host = Host()
    nft = shutil.which("nft") or "/usr/sbin/nft"

    def netlink() -> object:
        reader = host.nft_reader
        return reader.counters(), [reader.elements(nft_layout.set_name(r, f)) for f in (4, 6)
                                   for r in ipsets.COUNTED]

    def walk(document: dict[str, list[dict[str, object]]]) -> dict[str, object]:
        out: dict[str, object] = {}
        for item in document["nftables"]:
            if "counter" in item:
                counter = item["counter"]
                assert isinstance(counter, dict)
                out[counter["name"]] = (counter["packets"], counter["bytes"])
            elif "set" in item:
                found = item["set"]
                assert isinstance(found, dict)
                for elem in found.get("elem", []):
                    if isinstance(elem, dict) and "elem" in elem:
                        out[f"{found['name']} {elem['elem']['val']}"] = elem["elem"].get("counter")
        return out

    def fork_json() -> object:
        text = subprocess.run([nft, "-j", "list", "table", "inet", nft_layout.TABLE], capture_output=True,
                              text=True, check=True, timeout=10).stdout
        return walk(json.loads(text))

    lib = ctypes.CDLL("libnftables.so.1")
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    ctx = lib.nft_ctx_new(0)
    lib.nft_ctx_output_set_flags(ctx, 1 << 4)  # NFT_CTX_OUTPUT_JSON
    lib.nft_ctx_buffer_output(ctx)
    command = f"list table inet {nft_layout.TABLE}".encode()

    def libnftables_json() -> object:
        if lib.nft_run_cmd_from_buffer(ctx, command) != 0:
            raise RuntimeError("libnftables: list table failed")
        return walk(json.loads(lib.nft_ctx_get_output_buffer(ctx)))

    for label, fn in (("nfnetlink (used)", netlink), ("`nft -j list table`", fork_json),
                      ("libnftables JSON (ctypes)", libnftables_json)):
        med, p95 = timed(fn, max(5, rounds // 5))
        print(f"    table read via {label:<26} median {med:7.2f} ms  p95 {p95:7.2f} ms")
    host.close()


def inner(pod_counts: list[int], rounds: int, layout: str, backend: str) -> None:
    """Runs inside the namespace."""
    for count in pod_counts:
        engine = Netacct(NetacctConfig(enabled=True, layout=layout, backend=backend), Host())
        engine.sync(fake_pods(count))
        registry = CollectorRegistry()
        registry.register(NetacctCollector(engine))
        read = timed(engine.scrape, rounds)
        full = timed(lambda: generate_latest(registry), rounds)  # noqa: B023 (used within the iteration)
        series = generate_latest(registry).decode().count("\ngpu_node_agent_")
        where = {"nft": "nft table", "ebpf": "ebpf maps"}.get(layout, f"iptables-{backend}")
        print(f"  {where:<16} {count:>5} pods ({count * 8} set elements, {series} series): "
              f"read pass median {read[0]:6.2f} ms p95 {read[1]:6.2f} ms | full scrape with exposition "
              f"median {full[0]:6.2f} ms p95 {full[1]:6.2f} ms")
        if layout == "nft":
            nft_alternatives(rounds)
        elif layout == "iptables" and backend == "nft":
            alternatives([ipsets.set_name(r, f) for f in (4, 6) for r in ipsets.COUNTED], rounds)
        engine.remove_all()
        engine.close()


def main() -> int:
    """Create a namespace per backend and run the measurements inside it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, nargs="+", default=[110, 1000])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--layout", nargs="+", default=["nft", "iptables"], choices=["ebpf", "nft", "iptables"])
    parser.add_argument("--backend", nargs="+", default=["nft", "legacy"], choices=["nft", "legacy"],
                        help="iptables backends to run the iptables layout on")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        inner(args.pods, args.rounds, args.layout[0], args.backend[0])
        return 0
    if os.geteuid() != 0:
        print("needs root (ip netns, iptables, ipset)")
        return 2
    print(f"netacct scrape bench: {os.cpu_count()} CPUs, {os.uname().release}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs = [(layout, backend) for layout in args.layout
            for backend in (args.backend if layout == "iptables" else args.backend[:1])]
    for layout, backend in runs:
        ns = f"gna-bench-{uuid.uuid4().hex[:6]}"
        subprocess.run([IP, "netns", "add", ns], check=True, timeout=30)
        try:
            subprocess.run([IP, "netns", "exec", ns, sys.executable, __file__, "--inner", "--rounds",
                            str(args.rounds), "--layout", layout, "--backend", backend, "--pods",
                            *map(str, args.pods)], check=True, timeout=1800)
        finally:
            subprocess.run([IP, "netns", "del", ns], check=False, timeout=30)
    print(f"load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
