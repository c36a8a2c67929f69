"""Bench: per-pod internet shaping on a node with 250 pods, in network namespaces (tests/shaping/netns.py).

The node holds the test network's three pods (pod1 routed and pod2 bridged, both limited; pod3 routed, never
limited) plus 247 more host-side veths whose peers share one extra namespace; every other one of those is
limited too (125 shaped pods in all, 2 x 125 qdisc trees plus 125 IFBs). Figures (TCP, iperf3, receiver
goodput, median over rounds; shaping on and off interleaved round by round):

1. internet goodput / limit of pod1 and pod2, upload and download, at two limit pairs (goal 0.9-1.05; TCP
   goodput tops out at 1448/1514 = 0.956 of an L2 limit);
2. pod1's cluster goodput with its shapers on / off (goal >= 0.95: cluster traffic passes one u32 compare per
   internal CIDR and HTB's direct queue);
3. pod3's (unshaped) internet goodput with shaping on for the 125 others / off (goal >= 0.95);
4. time to apply all 250 pods, to re-check them with nothing to change, removal;
5. the counter scrape (`Shaper.scrape`: one class dump per shaped interface, `agent.host.tc_stats`): the first
   one, then median and p90 of `--scrapes` more; beside it, in the same run, what a scrape read before (one
   pyroute2 dump of every qdisc of the node, decoded) for comparison.

    sudo python bench/shaping.py [--rounds 3] [--seconds 3] [--backend nft] [--scrapes 200] [--scrape-only]
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.pods import DEFAULT_INTERNAL_CIDRS
from agent.host.tc_netlink import NetlinkTc
from agent.pods.model import Pod, make_pod
from agent.shaping.engine import Shaper
from agent.shaping.limits import EGRESS_ANNOTATION, INGRESS_ANNOTATION
from tests.shaping import netns
from tests.shaping.netns import CLUSTER, INET, POD1, POD2, POD3

INTERNAL = [ipaddress.ip_network(c) for c in DEFAULT_INTERNAL_CIDRS]
EXTRA = 247
LIMIT_PAIRS = ((20, 40), (200, 400))  # (egress, ingress) Mbit/s


def limits(up: int, down: int) -> dict[str, str]:
    """The two annotations."""
    return {EGRESS_ANNOTATION: f"{up}M", INGRESS_ANNOTATION: f"{down}M"}


def add_extra_pods(net: netns.Net) -> list[str]:
    """247 more routed veths whose peers live in one namespace; their IPs."""
    rest = f"gns-rest-{net.tag}"
    netns.sh("ip", "netns", "add", rest)
    node_cmds, rest_cmds, ips = [], [], []
    for i in range(EXTRA):
        ip = f"10.246.{i // 200}.{i % 200 + 2}"
        ips.append(ip)
        node_cmds.append(f"link add x{i} type veth peer name y{i} netns {rest}")
        node_cmds.append(f"link set x{i} up")
        node_cmds.append(f"route add {ip}/32 dev x{i} scope link")
        rest_cmds.append(f"link set y{i} up")
        rest_cmds.append(f"addr add {ip}/32 dev y{i}")
    for ns, cmds in ((net.node, node_cmds), (rest, rest_cmds)):
        subprocess.run(["ip", "-n", ns, "-batch", "-"], input=  # noqa: S607
                       "\n".join(cmds) + "\n", text=True, check=True,
                       capture_output=True, timeout=120)
    return ips


def pod_list(extra_ips: list[str], pair: tuple[int, int]) -> list[Pod]:
    """250 pods: pod1, pod2 and every other extra pod limited."""
    pods = [make_pod("bench", "pod1", [POD1], "u1", limits(*pair)),
            make_pod("bench", "pod2", [POD2], "u2", limits(*pair)),
            make_pod("bench", "pod3", [POD3], "u3")]
    pods += [make_pod("bench", f"x{i}", [ip], f"ux{i}", limits(*pair) if i % 2 == 0 else {})
             for i, ip in enumerate(extra_ips)]
    return pods


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call took."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def scrape_figures(shaper: Shaper, tc: NetlinkTc, scrapes: int) -> str:
    """First scrape, then median/p90 of `scrapes` more; and the old full-dump read, interleaved, for comparison."""
    first = timed(shaper.scrape)
    new, old = [], []
    for _ in range(scrapes):
        new.append(timed(shaper.scrape))
        old.append(timed(lambda: tc._leaf_counters(tc._dump())))  # the read a scrape did before

    def p90(values: list[float]) -> float:
        return statistics.quantiles(values, n=10)[-1]

    return (f"scrape: first {first * 1000:.1f} ms, median {statistics.median(new) * 1000:.2f} ms, "
            f"p90 {p90(new) * 1000:.2f} ms ({scrapes} scrapes); the old read (pyroute2 dump of every qdisc): "
            f"median {statistics.median(old) * 1000:.1f} ms, p90 {p90(old) * 1000:.1f} ms; "
            f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--backend", default="nft", choices=("nft", "legacy"))
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes timed after the first (default 200)")
    parser.add_argument("--scrape-only", action="store_true", help="apply, re-check, scrape and remove; no iperf3")
    args = parser.parse_args()
    reason = netns.missing_prerequisite()
    if reason:
        print(f"skipped: {reason}")
        return 0
    net = netns.build(args.backend)
    try:
        extra = add_extra_pods(net)
        netns.poke(net, "pod2", "10.244.2.1")
        tc = NetlinkTc(net.node)
        shaper = Shaper(tc, INTERNAL, {})
        run = lambda role, server, reverse=False: netns.mbps(net, role, server, reverse=reverse,  # noqa: E731
                                                             seconds=args.seconds)
        apply_s = timed(lambda: shaper.sync(pod_list(extra, LIMIT_PAIRS[0])))
        report = shaper.sync(pod_list(extra, LIMIT_PAIRS[0]))
        resync_s = timed(lambda: shaper.sync(pod_list(extra, LIMIT_PAIRS[0])))
        print(f"250 pods, {report.count('shaped')} shaped: apply {apply_s:.2f} s, re-check {resync_s * 1000:.0f} ms")
        print(scrape_figures(shaper, tc, args.scrapes))
        if args.scrape_only:
            print(f"removal of everything: {timed(shaper.remove_all):.2f} s")
            shaper.close()
            return 0
        for pair in LIMIT_PAIRS:
            shaper.sync(pod_list(extra, pair))
            ratios: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for role in ("pod1", "pod2"):
                    ratios.setdefault(f"{role} upload", []).append(run(role, INET) / pair[0])
                    ratios.setdefault(f"{role} download", []).append(run(role, INET, True) / pair[1])
            print(f"limits {pair[0]}/{pair[1]} Mbit/s up/down, goodput/limit (median of {args.rounds}): " +
                  ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in ratios.items()))
        samples: dict[str, dict[bool, list[float]]] = {}
        for _ in range(args.rounds):
            for on in random.sample((True, False), 2):  # shuffled, so drift on a shared VM does not pick a side
                if on:
                    shaper.sync(pod_list(extra, LIMIT_PAIRS[0]))
                else:
                    shaper.remove_all()
                for name, role, server, reverse in (("pod1 -> cluster", "pod1", CLUSTER, False),
                                                     ("cluster -> pod1", "pod1", CLUSTER, True),
                                                     ("pod3 -> internet", "pod3", INET, False),
                                                     ("internet -> pod3", "pod3", INET, True)):
                    samples.setdefault(name, {True: [], False: []})[on].append(run(role, server, reverse))
        for name, by in samples.items():
            on, off = statistics.median(by[True]), statistics.median(by[False])
            print(f"{name}: shaping on {on:,.0f} Mbit/s, off {off:,.0f} Mbit/s, ratio {on / off:.2f}")
        shaper.sync(pod_list(extra, LIMIT_PAIRS[0]))
        print(f"removal of everything: {timed(shaper.remove_all):.2f} s")
        shaper.close()
    finally:
        netns.sh("ip", "netns", "del", f"gns-rest-{net.tag}", check=False)
        netns.destroy(net)
    return 0


if __name__ == "__main__":
    sys.exit(main())
