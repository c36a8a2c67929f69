"""End to end: real packets through a node namespace, counted by netacct, match the scrape byte for byte.

The node forwards between a pod namespace and an "internet" namespace that also holds a cluster peer. Every flow
has its own packet count and size, so a packet counted under the wrong series shows up as a mismatch.
"""

from __future__ import annotations

import os
from collections import Counter

from agent.pods.model import Pod, make_pod
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory, RecordingHost, scrape
from tests.netacct.netns import INET4, INET6, NODE_UP4, NODE_UP6, PEER4, PEER6, POD4, POD6

HOSTILE_NS = 'ns"; touch /tmp/gna-pwned; echo "'
HOSTILE_POD = "$(reboot)\n-A INPUT -j DROP --comment `id` 'x' \\"
NODE_SERIES = [(d, t, s) for d in ("receive", "transmit") for t in ("internet", "cluster") for s in ("host", "pod")]

Series = Counter[tuple[str, ...]]


def pods() -> list[Pod]:
    """The pod under test and a second one whose names try to break out of a command line."""
    return [make_pod("team-a", "trainer-0", [POD4, POD6]),
            make_pod(HOSTILE_NS, HOSTILE_POD, [netns.OTHER_POD4, netns.OTHER_POD6])]


def series(registry: object) -> Series:
    """The values this test checks, keyed ("node", direction, traffic, scope, unit) or ("pod", ns, pod, ...)."""
    out: Series = Counter()
    for (name, labels), value in scrape(registry).items():  # type: ignore[arg-type]
        lab = dict(labels)
        for direction in ("receive", "transmit"):
            for unit in ("bytes", "packets"):
                if name == f"gpu_node_agent_network_{direction}_{unit}_total":
                    out[("node", direction, lab["traffic"], lab["scope"], unit)] = int(value)
            if name == f"gpu_node_agent_pod_network_{direction}_bytes_total":
                out[("pod", lab["namespace"], lab["pod"], direction, lab["traffic"])] = int(value)
    return out


def send_all(topo: netns.Topology) -> Series:
    """Run every flow once and return the expected increase of each series."""
    node, pod, inet = topo.node, topo.pod, topo.inet
    flows = [  # src ns, src, dst ns, dst, count, size, (direction, traffic, scope), pod direction or None
        (pod, POD4, inet, INET4, 7, 1000, ("transmit", "internet", "pod"), "transmit"),
        (inet, INET4, pod, POD4, 5, 700, ("receive", "internet", "pod"), "receive"),
        (pod, POD4, inet, PEER4, 3, 1200, ("transmit", "cluster", "pod"), "transmit"),
        (inet, PEER4, pod, POD4, 4, 500, ("receive", "cluster", "pod"), "receive"),
        (node, NODE_UP4, inet, INET4, 6, 300, ("transmit", "internet", "host"), None),
        (inet, INET4, node, NODE_UP4, 2, 900, ("receive", "internet", "host"), None),
        (node, NODE_UP4, inet, PEER4, 3, 400, ("transmit", "cluster", "host"), None),
        (inet, PEER4, node, NODE_UP4, 5, 600, ("receive", "cluster", "host"), None),
        (pod, POD6, inet, INET6, 8, 1100, ("transmit", "internet", "pod"), "transmit"),
        (inet, INET6, pod, POD6, 3, 650, ("receive", "internet", "pod"), "receive"),
        (pod, POD6, inet, PEER6, 2, 1300, ("transmit", "cluster", "pod"), "transmit"),
        (inet, PEER6, pod, POD6, 6, 450, ("receive", "cluster", "pod"), "receive"),
        (node, NODE_UP6, inet, INET6, 4, 350, ("transmit", "internet", "host"), None),
        (inet, INET6, node, NODE_UP6, 3, 950, ("receive", "internet", "host"), None),
        (node, NODE_UP6, inet, PEER6, 5, 250, ("transmit", "cluster", "host"), None),
        (inet, PEER6, node, NODE_UP6, 2, 800, ("receive", "cluster", "host"), None),
    ]
    expected: Series = Counter()
    for src_ns, src, dst_ns, dst, count, size, key, pod_direction in flows:
        packets, octets = netns.flow(src_ns, src, dst_ns, dst, count=count, size=size)
        expected[("node", *key, "packets")] += packets
        expected[("node", *key, "bytes")] += octets
        if pod_direction:
            expected[("pod", "team-a", "trainer-0", pod_direction, key[1])] += octets
    return expected


def delta(after: Series, before: Series) -> Series:
    """after - before for every key of either (zeros kept, so a missing increase is a mismatch)."""
    return Counter({key: after.get(key, 0) - before.get(key, 0) for key in set(after) | set(before)})


def complete(expected: Series, hostile_zero: bool = True) -> Series:
    """Add the zero series: every node series, every pod series of both pods."""
    full: Series = Counter({("node", *k, unit): 0 for k in NODE_SERIES for unit in ("bytes", "packets")})
    for direction in ("receive", "transmit"):
        for traffic in ("internet", "cluster"):
            full[("pod", "team-a", "trainer-0", direction, traffic)] = 0
            if hostile_zero:
                full[("pod", HOSTILE_NS, HOSTILE_POD, direction, traffic)] = 0
    full.update(expected)
    return full


def test_counts_match_exactly_ipv4_and_ipv6(topology: netns.Topology, make_engine: EngineFactory,
                                           accounting: dict[str, str]) -> None:
    engine, registry = make_engine(**accounting)
    engine.sync(pods())
    before = series(registry)
    assert set(complete(Counter())) <= set(before)  # every series is present from the first scrape
    expected = send_all(topology)
    assert delta(series(registry), before) == complete(expected)
    # a second round adds exactly as much again: nothing was double counted or reset by the scrapes
    middle = series(registry)
    assert delta(series(registry), middle) == complete(Counter())
    assert delta(series(registry), before) == complete(expected)
    again = send_all(topology)
    assert delta(series(registry), middle) == complete(again)
    assert engine.layout == accounting["layout"]
    assert registry.get_sample_value("gpu_node_agent_netacct_layout_info", {"layout": accounting["layout"]}) == 1
    if accounting["layout"] == "iptables":
        assert engine.mode == accounting["backend"]


def test_hostile_pod_names_never_reach_a_command_line(topology: netns.Topology, make_engine: EngineFactory,
                                                      accounting: dict[str, str]) -> None:
    engine, registry = make_engine(**accounting)
    engine.sync(pods())
    engine.sync(pods()[:1])
    engine.sync(pods())
    host = engine.host
    assert isinstance(host, RecordingHost)
    assert host.calls or accounting["layout"] == "ebpf"  # the eBPF layout runs no command at all
    for argv, stdin in host.calls:
        for text in (*argv, stdin):
            for part in ("pwned", "reboot", "DROP", "team-a", "trainer", "`id`"):
                assert part not in text
    labels = {key[1:3] for key in series(registry) if key[0] == "pod"}
    assert labels == {("team-a", "trainer-0"), (HOSTILE_NS, HOSTILE_POD)}
    assert not any("pwned" in name for name in os.listdir("/tmp"))
