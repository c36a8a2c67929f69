"""What single nftables shapes cost 64-byte UDP forwarding here: the floor under netacct's native layout.

Each shape is one table with one forward base chain at netacct's priority, installed alone in the node namespace
of the accounting tests' pod -> node -> internet topology (tests/netacct/netns.py); the rate is the node's
forwarded datagrams/s from one sender, shapes interleaved in a shuffled order round by round, medians reported
against no table at all. It answers "how close to no accounting can any per-pod counting get": a counted set
lookup (one per forwarded packet is the least per-pod accounting needs) against an empty chain, a named
counter, two interval-set lookups and prefix compares (how the layout tells cluster from internet).

    python bench/nft_shapes.py [--seconds 2] [--rounds 4]      (root; nft and ip netns)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netacct_forwarding import Bench  # run as a script, bench/ is on sys.path

from agent.config.pods import DEFAULT_INTERNAL_CIDRS
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    topo = netns.build()
    bench = Bench(topo, "nft", "nft", args.seconds)
    rates: dict[str, list[float]] = {name: [] for name in SHAPES}
    print(f"nft shapes: 2 s x {args.rounds} rounds, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    try:
        order = random.Random(11)
        for _ in range(args.rounds):
            for name in order.sample(list(SHAPES), len(SHAPES)):
                netns.sh("nft", "flush", "ruleset", ns=topo.node)
                payload = SHAPES[name]
                if payload:
                    netns.sh("nft", "-f", "-", ns=topo.node, stdin=payload)
                rates[name].append(bench.udp_kpps())
    finally:
        bench.engine.close()
        netns.destroy(topo)
    base = statistics.median(rates["none"])
    print(f"  {'shape':<22}{'UDP-64 kpps':>12} {'/none':>6}   rounds")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"  {name:<22}{median:>12.1f} {median / base:>6.2f}   {' '.join(f'{v:.0f}' for v in values)}")
    print(f"  load average after the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
