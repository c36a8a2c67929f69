"""End to end, native nftables layout: auto selection, migration between layouts, repair, cleanup, bad input, and
why priority -300 (a drop at mangle priority does not hide traffic), with real packets in the node namespace."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from agent.config.netacct import NetacctConfig
from agent.host import netfilter
from agent.host.netfilter import Host
from agent.netacct import nft_layout, rules
from agent.netacct.command import cleanup_command
from agent.netacct.engine import Netacct, SyncError
from agent.pods.model import Pod
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory, RecordingHost
from tests.netacct.netns import INET4, POD4, POD6
from tests.netacct.test_e2e_counts import Series, complete, delta, pods, send_all, series
from tests.netacct.test_e2e_lifecycle import our_lines

T = nft_layout.TABLE


@pytest.fixture
def nft_works(topology: netns.Topology) -> None:
    """Skip where `nft` is missing or does not work in a namespace here."""
    try:
        netns.sh("nft", "list", "tables", ns=topology.node)
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"nft does not work in a network namespace here: {exc}")


def nft(ns: str, *command: str) -> str:
    """One nft command in the namespace (as a test's own tampering or foreign state)."""
    return netns.sh("nft", *command, ns=ns)


def test_auto_picks_nft_here_and_iptables_without_nft(topology: netns.Topology, make_engine: EngineFactory,
                                                      nft_works: None, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")  # a pin directory that cannot be made: the eBPF layout does not work here
    unusable = str(tmp_path / "file" / "bpffs")
    engine, registry = make_engine(bpffs_dir=unusable)
    engine.sync(pods())
    assert engine.layout == "nft"
    assert registry.get_sample_value("gpu_node_agent_netacct_layout_info", {"layout": "nft"}) == 1
    assert registry.get_sample_value("gpu_node_agent_netacct_backend_info", {"backend": "nftables"}) == 1
    assert "gpu_node_agent_netacct_probe" not in nft(topology.node, "list", "tables")  # the probe cleans up
    engine.remove_all()

    bin_dir = tmp_path / "bin"  # every tool of this machine except nft: the binary is really absent
    bin_dir.mkdir()
    for directory in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name != "nft" and not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(os.path.join(directory, name))
    monkeypatch.setenv("PATH", str(bin_dir))
    fallback = Netacct(NetacctConfig(enabled=True, bpffs_dir=unusable), Host(netns=topology.node))
    try:
        fallback.sync(pods())
        assert fallback.layout == "iptables"
        assert netns.members(topology.node, "gna-rx-inet4") == {POD4, netns.OTHER_POD4}
        assert fallback.scrape().layout == "iptables"
    finally:
        fallback.remove_all()  # while the tools it resolved still exist
        fallback.close()
        netfilter._resolve.cache_clear()  # forget tool paths under tmp_path


def restart(make_engine: EngineFactory, before: Series, topology: netns.Topology, **config: object) -> Series:
    """A new agent process (fresh engine, book and registry) over the same namespace: its totals continue exactly
    from `before` (no drop, nothing counted twice), and new traffic adds exactly; its totals after that traffic."""
    engine, registry = make_engine(**config)
    engine.sync(pods())
    assert series(registry) == before
    expected = send_all(topology)
    after = series(registry)
    assert delta(after, before) == complete(expected)
    engine.close()
    return after


def test_migration_carries_totals_both_ways(topology: netns.Topology, make_engine: EngineFactory, mode: str,
                                            nft_works: None) -> None:
    node = topology.node
    old, old_registry = make_engine(layout="iptables", backend=mode)
    old.sync(pods())
    send_all(topology)
    carried = series(old_registry)
    old.close()

    new, registry = make_engine(layout="nft")  # a restart with another layout: empty book
    new.sync(None)  # pods not known yet: the old layout keeps counting, nothing moves
    assert netns.nft_table(node) is None and netns.members(node, "gna-rx-inet4") == {POD4, netns.OTHER_POD4}
    waiting = node_series(series(registry))  # and scrapes read it: the node totals continue, never zero
    assert waiting == node_series(carried) and any(waiting.values())
    assert registry.get_sample_value("gpu_node_agent_netacct_layout_info", {"layout": "iptables"}) == 1
    carried_while_waiting = send_all(topology)
    assert delta(node_series(series(registry)), waiting) == node_series(complete(carried_while_waiting))
    carried = series(registry) | {k: v + carried_while_waiting.get(k, 0) for k, v in carried.items() if k[0] == "pod"}
    new.sync(pods())
    listed = netns.nft_table(node) or ""
    assert listed and nft_layout.CARRY_MARKER not in listed
    assert our_lines(node, mode, 4) == [] and our_lines(node, mode, 6) == []
    assert not [n for n in netns.sh("ipset", "list", "-n", ns=node).split() if n.startswith("gna-")]
    assert series(registry) == carried  # the old layout's final counts carried, per pod too: nothing went back
    expected = send_all(topology)
    before_restart = series(registry)
    assert delta(before_restart, carried) == complete(expected)
    new.close()
    # The carried counts live in the kernel: later restarts continue from the exported totals.
    kernel = restart(make_engine, before_restart, topology, layout="nft")
    kernel = restart(make_engine, kernel, topology, layout="nft")

    back, back_registry = make_engine(layout="iptables", backend=mode)
    back.sync(pods())
    assert netns.nft_table(node) is None
    assert rules.MARKER not in netns.sh(f"iptables-{mode}-save", "-t", "mangle", ns=node)
    assert series(back_registry) == kernel  # and back: the table's final counts carried
    expected = send_all(topology)
    before_restart = series(back_registry)
    assert delta(before_restart, kernel) == complete(expected)
    back.close()
    restart(make_engine, before_restart, topology, layout="iptables", backend=mode)


def node_series(values: Series) -> Series:
    """The node's series only (per-pod series need the pod list)."""
    return Series({k: v for k, v in values.items() if k[0] == "node"})


class DyingHost(RecordingHost):
    """A host whose agent dies (every later command fails) right after the command that `after` matches."""

    def __init__(self, *args: object, after: str, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.after = after
        self.dead = False

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Fail once dead; die after the matching command has run."""
        if self.dead:
            raise netfilter.CommandError("the agent was killed")
        out = super().run(argv, stdin, timeout)
        self.dead = self.after in " ".join(argv) + (stdin or "")
        return out


CUTS = {  # old layout, new layout, and the command after which the agent dies
    "to-nft": ("iptables", "nft", nft_layout.CARRY_MARKER),  # the preloaded table is in, the iptables layout too
    "to-iptables": ("nft", "iptables", "ipset"),  # the preloaded sets are in, no rule yet, the table still there
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_migration_cut_short_neither_loses_nor_doubles(topology: netns.Topology, make_engine: EngineFactory,
                                                          nft_works: None, cut: str) -> None:
    old_layout, new_layout, dies_after = CUTS[cut]
    old, old_registry = make_engine(layout=old_layout, backend="nft")
    old.sync(pods())
    send_all(topology)
    carried = series(old_registry)
    dying = Netacct(NetacctConfig(enabled=True, layout=new_layout, backend="nft"),
                    DyingHost(netns=topology.node, after=dies_after))
    try:
        with pytest.raises(SyncError):
            dying.sync(pods())
    finally:
        dying.close()
    assert netns.nft_table(topology.node) is not None  # both layouts exist now
    assert netns.members(topology.node, "gna-rx-inet4") == {POD4, netns.OTHER_POD4}
    restart(make_engine, carried, topology, layout=new_layout, backend="nft")
    assert (netns.nft_table(topology.node) is None) == (new_layout == "iptables")


def test_repairs_tampering_and_rebuilds_an_incompatible_set(topology: netns.Topology, make_engine: EngineFactory,
                                                           nft_works: None) -> None:
    node = topology.node
    engine, registry = make_engine(layout="nft")
    engine.sync(pods())
    send_all(topology)
    old = series(registry)
    nft(node, "flush", "chain", "inet", T, "fwd4_internet_cluster")
    nft(node, "delete", "element", "inet", T, "rx_inet4", f"{{ {POD4} }}")
    engine.sync(pods())
    assert POD4 in netns.nft_members(node, "rx_inet4")
    listed = netns.nft_table(node) or ""
    state = engine.nft.read(full=True)
    shape = nft_layout.classifiers(engine.nft.networks, engine.nft.members(state), (4, 6))
    assert all(f'comment "{rule.comment}"' in listed for rules in nft_layout.desired_rules(shape).values()
               for rule in rules)
    now = series(registry)
    assert all(now[key] >= old[key] for key in old)
    expected = send_all(topology)
    assert delta(series(registry), now) == complete(expected)

    # A set of the right name but without counters (an older or foreign definition): the table is re-created.
    before = series(registry)
    nft(node, "flush", "table", "inet", T)  # every rule, so that the set can go
    nft(node, "delete", "set", "inet", T, "rx_inet4")
    nft(node, "add", "set", "inet", T, "rx_inet4", "{ type ipv4_addr; }")
    engine.sync(pods())
    assert "counter" in nft(node, "list", "set", "inet", T, "rx_inet4")
    rebuilt = series(registry)
    assert all(rebuilt[key] >= before[key] for key in before)  # counts before the rebuild are kept
    expected = send_all(topology)
    assert delta(series(registry), rebuilt) == complete(expected)


@pytest.fixture
def foreign_nft(topology: netns.Topology, nft_works: None) -> Iterator[None]:
    """Someone else's nftables table, which cleanup must leave alone."""
    nft(topology.node, "add", "table", "inet", "someone_else")
    nft(topology.node, "add", "set", "inet", "someone_else", "peers", "{ type ipv4_addr; counter; }")
    nft(topology.node, "add", "element", "inet", "someone_else", "peers", "{ 192.0.2.1 }")
    yield
    netns.sh("nft", "delete", "table", "inet", "someone_else", ns=topology.node, check=False)


def test_cleanup_removes_the_table_and_nothing_else(topology: netns.Topology, make_engine: EngineFactory,
                                                    foreign_nft: None) -> None:
    before = netns.save_state(topology.node)
    engine, _ = make_engine(layout="nft")
    engine.sync(pods())
    send_all(topology)
    assert netns.save_state(topology.node) != before
    config = NetacctConfig(enabled=True, ipv6=False, layout="iptables")  # whatever the config says now
    assert cleanup_command(config, host=Host(netns=topology.node)) == 0
    assert netns.save_state(topology.node) == before
    assert cleanup_command(config, host=Host(netns=topology.node)) == 0
    assert netns.save_state(topology.node) == before


def test_bad_addresses_never_reach_the_payload(topology: netns.Topology, make_engine: EngineFactory,
                                               nft_works: None) -> None:
    hostile = Pod("team-a", "trainer-0", (POD4, "10.0.0.1 }; flush ruleset", "fd00::1/64", POD6))
    engine, _ = make_engine(layout="nft")
    engine.sync([hostile])  # skipped addresses are logged, the rest is counted
    assert netns.nft_members(topology.node, "rx_inet4") == {POD4}
    assert netns.nft_members(topology.node, "tx_clus6") == {POD6}
    host = engine.host
    assert isinstance(host, RecordingHost)
    assert not any("flush ruleset" in stdin or "fd00::1/64" in stdin for _, stdin in host.calls)


def test_turning_ipv6_off_removes_its_objects(topology: netns.Topology, make_engine: EngineFactory,
                                             nft_works: None) -> None:
    full, _ = make_engine(layout="nft")
    full.sync(pods())
    v4only, registry = make_engine(layout="nft", ipv6=False)
    v4only.sync(pods())
    listed = netns.nft_table(topology.node) or ""
    assert "ip6 " not in listed and "internal6" not in listed and "_host6" not in listed
    before = series(registry)
    _, octets = netns.flow(topology.pod, POD4, topology.inet, INET4, count=3, size=200)
    assert delta(series(registry), before)[("node", "transmit", "internet", "pod", "bytes")] == octets


def test_a_drop_at_mangle_priority_does_not_hide_traffic(topology: netns.Topology, make_engine: EngineFactory,
                                                         nft_works: None) -> None:
    node = topology.node
    engine, registry = make_engine(layout="nft")
    engine.sync(pods())
    nft(node, "add", "table", "inet", "dropper")
    nft(node, "add", "chain", "inet", "dropper", "early", "{ type filter hook forward priority -150; policy accept; }")
    nft(node, "add", "rule", "inet", "dropper", "early", "ip", "daddr", INET4, "udp", "dport", "!=", "0", "drop")
    try:
        before = series(registry)
        with netns.udp_socket(topology.pod, 4, POD4) as tx:
            for _ in range(4):
                tx.sendto(b"\x5a" * 300, (INET4, 9))  # dropped after the node has counted it
        key = ("node", "transmit", "internet", "pod", "bytes")
        deadline = time.monotonic() + 30
        while delta(series(registry), before)[key] < 4 * 328 and time.monotonic() < deadline:
            time.sleep(0.05)  # packets are in flight through three namespaces; poll the real counters
        assert delta(series(registry), before)[key] == 4 * 328
        assert delta(series(registry), before)[("pod", "team-a", "trainer-0", "transmit", "internet")] == 4 * 328
    finally:
        netns.sh("nft", "delete", "table", "inet", "dropper", ns=node, check=False)


def test_pods_outside_the_internal_cidrs_count_as_the_iptables_layout_counts(
        topology: netns.Topology, make_engine: EngineFactory, nft_works: None) -> None:
    # The pod's own addresses are not internal here (public pod IPs): the lookups the native layout leaves out
    # while every pod is internal must come back, so both layouts count the same flows into the same series.
    internal = ["10.9.0.0/16", "fd00:9::/32"]  # the cluster peers only
    counted: dict[str, Series] = {}
    for layout in ("iptables", "nft"):
        engine, registry = make_engine(layout=layout, internal_cidrs=internal)
        engine.sync(pods())
        before = series(registry)
        expected = send_all(topology)
        counted[layout] = delta(series(registry), before)
        engine.remove_all()
    assert counted["nft"] == counted["iptables"]
    pod_rx = counted["nft"][("pod", "team-a", "trainer-0", "receive", "cluster")]
    assert pod_rx == expected[("pod", "team-a", "trainer-0", "receive", "cluster")] > 0
    assert counted["nft"][("pod", "team-a", "trainer-0", "transmit", "internet")] == \
        expected[("pod", "team-a", "trainer-0", "transmit", "internet")] > 0
