"""End to end lifecycle in the node namespace: pods coming and going, restarts, tampering, cleanup, detection."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest

from agent.config.netacct import NetacctConfig
from agent.host import bpf, bpf_tc
from agent.host.netfilter import Host
from agent.netacct import rules
from agent.netacct.command import cleanup_command
from agent.pods.model import make_pod
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory, RecordingHost
from tests.netacct.netns import INET4, INET6, POD4, POD6
from tests.netacct.test_e2e_counts import complete, delta, pods, send_all, series

TRAINER = make_pod("team-a", "trainer-0", [POD4, POD6])
TOOL = {("nft", 4): "iptables-nft", ("nft", 6): "ip6tables-nft", ("legacy", 4): "iptables-legacy",
        ("legacy", 6): "ip6tables-legacy"}


def our_lines(ns: str, mode: str, family: int) -> list[str]:
    """netacct's rule lines in a save (without counters), in order."""
    save = netns.sh(f"{TOOL[(mode, family)]}-save", "-t", "mangle", ns=ns)
    return [line for line in save.splitlines() if rules.COMMENT in line]


def pod_series(values: Counter[tuple[str, ...]]) -> set[tuple[str, str]]:
    """(namespace, pod) of every per-pod series."""
    return {key[1:3] for key in values if key[0] == "pod"}


def test_pods_added_removed_and_moved(topology: netns.Topology, make_engine: EngineFactory,
                                      accounting: dict[str, str], bpffs: str) -> None:
    engine, registry = make_engine(**accounting)
    layout = accounting["layout"]
    engine.sync([])
    before = series(registry)
    assert pod_series(before) == set()
    netns.flow(topology.pod, POD4, topology.inet, INET4, count=3, size=500)
    after = series(registry)
    assert delta(after, before)[("node", "transmit", "internet", "pod", "bytes")] == 3 * 528  # no pod needed

    engine.sync([TRAINER])
    assert netns.layout_members(topology.node, layout, "tx-inet", 4, bpffs) == {POD4}
    assert netns.layout_members(topology.node, layout, "rx-clus", 6, bpffs) == {POD6}
    start = series(registry)
    assert start[("pod", "team-a", "trainer-0", "transmit", "internet")] == 0
    netns.flow(topology.pod, POD6, topology.inet, INET6, count=2, size=100)
    assert series(registry)[("pod", "team-a", "trainer-0", "transmit", "internet")] == 2 * 148

    engine.sync([])
    gone = series(registry)
    assert pod_series(gone) == set()
    assert all(not netns.layout_members(topology.node, layout, r, f, bpffs) for r in ("rx-inet", "tx-clus")
               for f in (4, 6))
    assert all(gone[k] >= after[k] for k in after)  # node totals never go down

    moved = make_pod("team-b", "trainer-1", [POD4])
    engine.sync([TRAINER])
    netns.flow(topology.inet, INET4, topology.pod, POD4, count=4, size=200)
    engine.sync([moved])  # the address now belongs to another pod
    netns.flow(topology.inet, INET4, topology.pod, POD4, count=1, size=300)
    final = series(registry)
    assert pod_series(final) == {("team-b", "trainer-1")}
    assert final[("pod", "team-b", "trainer-1", "receive", "internet")] == 328


def writes(host: object) -> list[list[str]]:
    """The commands a RecordingHost ran that change kernel state (restores, `nft -f`)."""
    assert isinstance(host, RecordingHost)
    return [argv for argv, _ in host.calls if "restore" in " ".join(argv) or argv[-2:] == ["-f", "-"]]


def installed(ns: str, accounting: dict[str, str], bpffs: str) -> object:
    """netacct's rules as the kernel lists them (counters left out), in the layout under test (ebpf: the pins and
    the programs on each tcx hook: a rewrite would load new programs)."""
    if accounting["layout"] == "ebpf":
        hooks = {}
        for iface in bpf_tc.interfaces(ns):
            with netns.entered(ns):
                hooks[iface.name] = [bpf.prog_query(iface.index, a) for a in (bpf.TCX_INGRESS, bpf.TCX_EGRESS)]
        return sorted(os.listdir(bpffs)), hooks
    if accounting["layout"] == "nft":
        return netns.nft_table(ns)
    return {f: our_lines(ns, accounting["backend"], f) for f in (4, 6)}


def test_restart_keeps_counters_and_adds_no_duplicates(topology: netns.Topology, make_engine: EngineFactory,
                                                       accounting: dict[str, str], bpffs: str) -> None:
    first, first_registry = make_engine(**accounting)
    first.sync(pods())
    send_all(topology)
    carried = series(first_registry)
    before = installed(topology.node, accounting, bpffs)
    first.close()

    second, registry = make_engine(**accounting)  # a new process: empty book, rules and sets already there
    second.sync(pods())
    second.sync(pods())
    assert not writes(second.host)  # nothing rewritten
    assert installed(topology.node, accounting, bpffs) == before
    if accounting["layout"] == "iptables":
        for family in (4, 6):
            assert len(our_lines(topology.node, accounting["backend"], family)) == 3 + 12  # 3 jumps, 12 rules
    assert series(registry) == carried  # totals continue from the kernel counters
    expected = send_all(topology)
    assert delta(series(registry), carried) == complete(expected)


def test_repairs_tampering_and_keeps_totals_monotonic(topology: netns.Topology, make_engine: EngineFactory,
                                                      mode: str) -> None:
    engine, registry = make_engine(layout="iptables", backend=mode)
    engine.sync(pods())
    send_all(topology)
    old = series(registry)
    ipt = TOOL[(mode, 4)]
    netns.sh(ipt, "-w", "5", "-t", "mangle", "-D", "GNA-NETACCT-FWD", "1", ns=topology.node)
    netns.sh(ipt, "-w", "5", "-t", "mangle", "-I", "FORWARD", "1", "-m", "comment", "--comment",
             rules.JUMP_COMMENT, "-j", "GNA-NETACCT-FWD", ns=topology.node)
    netns.sh("ipset", "del", "gna-rx-inet4", POD4, ns=topology.node)
    engine.sync(pods())
    repaired = our_lines(topology.node, mode, 4)
    assert len(repaired) == 15 and len(set(repaired)) == 15
    assert [line for line in repaired if line.startswith("-A GNA-NETACCT-FWD ")] == \
        [rule.line() for rule in rules.desired(4) if rule.chain == "GNA-NETACCT-FWD"]
    assert POD4 in netns.members(topology.node, "gna-rx-inet4")
    now = series(registry)
    assert all(now[key] >= old[key] for key in old)
    expected = send_all(topology)
    assert delta(series(registry), now) == complete(expected)


@pytest.fixture
def foreign(topology: netns.Topology, mode: str) -> Iterator[None]:
    """Rules and a set that belong to someone else (the kubelet's hint chain among them)."""
    node = topology.node
    for family in (4, 6):
        ipt = TOOL[(mode, family)]
        netns.sh(ipt, "-w", "5", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT", ns=node)
        netns.sh(ipt, "-w", "5", "-t", "mangle", "-A", "FORWARD", "-m", "comment", "--comment", "someone else",
                 ns=node)
    netns.sh("ipset", "create", "someone-else", "hash:ip", ns=node)
    netns.sh("ipset", "add", "someone-else", "192.0.2.1", ns=node)
    yield
    for family in (4, 6):
        ipt = TOOL[(mode, family)]
        netns.sh(ipt, "-w", "5", "-t", "mangle", "-D", "FORWARD", "-m", "comment", "--comment", "someone else",
                 ns=node, check=False)
        netns.sh(ipt, "-w", "5", "-t", "mangle", "-X", "KUBE-IPTABLES-HINT", ns=node, check=False)
    netns.sh("ipset", "destroy", "someone-else", ns=node, check=False)


def test_cleanup_leaves_the_namespace_as_it_was(topology: netns.Topology, make_engine: EngineFactory, mode: str,
                                                foreign: None) -> None:
    before = netns.save_state(topology.node)
    engine, _ = make_engine(layout="iptables")  # auto backend: the hint chain decides it
    engine.sync(pods())
    assert engine.mode == mode
    send_all(topology)
    assert netns.save_state(topology.node) != before
    config = NetacctConfig(enabled=True, ipv6=False)  # cleanup removes IPv6 too, whatever the config says
    assert cleanup_command(config, host=Host(netns=topology.node)) == 0
    assert netns.save_state(topology.node) == before
    assert cleanup_command(config, host=Host(netns=topology.node)) == 0  # twice is harmless
    assert netns.save_state(topology.node) == before


def test_backend_detection_follows_the_hint_chain(topology: netns.Topology) -> None:
    host = Host(netns=topology.node)
    assert host.detect_mode() == "nft"  # no hint anywhere: nft
    try:
        netns.sh("ip6tables-legacy", "-w", "5", "-t", "mangle", "-N", "KUBE-KUBELET-CANARY", ns=topology.node)
        assert host.detect_mode() == "legacy"
        netns.sh("iptables-nft", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT", ns=topology.node)
        assert host.detect_mode() == "nft"  # nft is looked at first, as iptables-wrappers does
    except RuntimeError as exc:
        pytest.skip(f"backend not usable here: {exc}")
    finally:
        netns.sh("ip6tables-legacy", "-w", "5", "-t", "mangle", "-X", "KUBE-KUBELET-CANARY", ns=topology.node,
                 check=False)
        netns.sh("iptables-nft", "-t", "mangle", "-X", "KUBE-IPTABLES-HINT", ns=topology.node, check=False)


@pytest.mark.parametrize("layout", ["nft", "iptables"])
def test_changing_the_internal_cidrs_keeps_every_count(topology: netns.Topology, make_engine: EngineFactory,
                                                    layout: str) -> None:
    engine, registry = make_engine(layout=layout)
    engine.sync(pods())
    send_all(topology)
    old = series(registry)
    wider, wider_registry = make_engine(layout=layout, internal_cidrs=["10.0.0.0/8", "203.0.113.0/24", "fd00::/8"])
    wider.sync(pods())
    assert isinstance(wider.host, RecordingHost)
    changes = [(argv, stdin) for argv, stdin in wider.host.calls if argv in writes(wider.host)]
    assert len(changes) == 1  # one transaction
    if layout == "nft":  # set members, and the rules that compare the CIDRs inline; no counter or set re-created
        assert all(" element " in line or line.startswith(("add table", "flush set", "flush chain", "add rule"))
                   for line in changes[0][1].splitlines())
        assert netns.nft_members(topology.node, "internal4") == {"10.0.0.0/8", "203.0.113.0/24"}
    else:
        assert "ipset" in changes[0][0][0]
        assert netns.members(topology.node, "gna-internal4") == {"10.0.0.0/8", "203.0.113.0/24"}
    assert series(wider_registry) == old
    netns.flow(topology.pod, POD4, topology.inet, INET4, count=2, size=100)  # now cluster traffic
    now = series(wider_registry)
    assert now[("node", "transmit", "cluster", "pod", "bytes")] - old[("node", "transmit", "cluster", "pod",
                                                                         "bytes")] == 256
    assert now[("node", "transmit", "internet", "pod", "bytes")] == old[("node", "transmit", "internet", "pod",
                                                                         "bytes")]


def test_switching_backend_or_turning_ipv6_off_moves_the_rules(topology: netns.Topology,
                                                               make_engine: EngineFactory) -> None:
    try:
        netns.sh("iptables-legacy", "-w", "5", "-t", "mangle", "-S", "INPUT", ns=topology.node)
    except RuntimeError as exc:
        pytest.skip(f"iptables-legacy does not work in a network namespace here: {exc}")
    legacy, _ = make_engine(layout="iptables", backend="legacy")
    legacy.sync(pods())
    nft, registry = make_engine(layout="iptables", backend="nft")
    nft.sync(pods())  # the hint moved to nft: the legacy copy would count pod traffic into the sets twice
    assert our_lines(topology.node, "legacy", 4) == [] and our_lines(topology.node, "legacy", 6) == []
    assert len(our_lines(topology.node, "nft", 4)) == 15
    before = series(registry)
    expected = send_all(topology)
    assert delta(series(registry), before) == complete(expected)
    v4only, _ = make_engine(layout="iptables", backend="nft", ipv6=False)
    v4only.sync(pods())
    assert our_lines(topology.node, "nft", 6) == [] and len(our_lines(topology.node, "nft", 4)) == 15
