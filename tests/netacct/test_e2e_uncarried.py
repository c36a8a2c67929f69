"""End to end: a migration to the iptables layout where the kernel does not keep a preloaded rule counter.

ip6tables-nft 1.8.9 drops the `[packets:bytes]` of restored IPv6 rule lines (seen on this machine; the engine
therefore carries each node total in the IPv4 rule alone). Here the IPv4 restore drops them too, as another
iptables build might: `CountersDroppedOnRestore` takes the counters out of the IPv4 iptables-restore payload and
passes everything else, unchanged, to the real kernel in the node namespace. The engine finds the counters missing
when it reads them back (`Netacct._check_carried`) and keeps that carry in its book: the exported totals do not
drop at the migration, and new traffic adds exactly. The price, as README says, is the next restart: a new
process sums the kernel's values, and the part only the old process's memory held is gone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from agent.config.netacct import NetacctConfig
from agent.host import netfilter
from agent.netacct import rules
from agent.netacct.collector import NetacctCollector
from agent.netacct.engine import Netacct
from tests.netacct import netns
from tests.netacct.conftest import EngineFactory, RecordingHost
from tests.netacct.netns import INET4, POD4
from tests.netacct.test_e2e_counts import Series, complete, delta, pods, send_all, series
from tests.netacct.test_e2e_lifecycle import TOOL
from tests.netacct.test_e2e_nft import nft_works, node_series

__all__ = ["nft_works"]  # the fixture

RULE_COUNTERS = re.compile(r"^\[\d+:\d+\] ", re.MULTILINE)


class CountersDroppedOnRestore(RecordingHost):
    """A host whose IPv4 iptables-restore (of backend `mode`) ignores the counters of rule lines."""

    def __init__(self, mode: str, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.restore_argv = netfilter._tool(mode, 4, "restore")
        self.stripped = 0

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Take the `[N:M]` prefixes out of an IPv4 restore payload, then run it for real."""
        if stdin and list(argv[:len(self.restore_argv)]) == self.restore_argv:
            stdin, dropped = RULE_COUNTERS.subn("", stdin)
            self.stripped += dropped
        return super().run(argv, stdin, timeout)


def pod_series(values: Series) -> Series:
    return Series({k: v for k, v in values.items() if k[0] == "pod"})


def kernel_rule_counters(node: str, mode: str, family: int) -> dict[str, tuple[int, int]]:
    return rules.counters(rules.parse(netns.sh(f"{TOOL[(mode, family)]}-save", "-c", "-t", "mangle", ns=node)))


def test_a_carried_rule_counter_the_kernel_did_not_keep_stays_in_memory(
        topology: netns.Topology, make_engine: EngineFactory, mode: str, nft_works: None) -> None:
    node = topology.node
    old, old_registry = make_engine(layout="nft")
    old.sync(pods())
    send_all(topology)
    carried = series(old_registry)
    assert all(v > 0 for k, v in node_series(carried).items() if k[4] == "packets")  # every node total to carry
    carry = carried[("node", "transmit", "internet", "pod", "packets")]
    assert 0 < carry < 40  # the flow below outgrows it
    old.close()

    config = NetacctConfig(enabled=True, layout="iptables", backend=mode)
    host = CountersDroppedOnRestore(mode, netns=node)
    engine = Netacct(config, host)  # a restart with the other layout, on an iptables that drops the counters
    registry = CollectorRegistry()
    registry.register(NetacctCollector(engine, per_pod=config.per_pod_metrics))
    try:
        engine.sync(pods())
        assert netns.nft_table(node) is None  # migrated: the table is gone
        assert host.stripped > 0  # the carry was in the payload ...
        assert set(kernel_rule_counters(node, mode, 4).values()) == {(0, 0)}  # ... and the kernel kept none of it
        # Before the first read, more IPv4 traffic than the lost carry: had the book taken the carry as the rule's
        # starting value, this raw value would read as carry + new traffic and the carry would be subtracted.
        packets, octets = netns.flow(topology.pod, POD4, topology.inet, INET4, count=40, size=1200)
        first = Series(carried)
        first.update({("node", "transmit", "internet", "pod", "packets"): packets,
                      ("node", "transmit", "internet", "pod", "bytes"): octets,
                      ("pod", "team-a", "trainer-0", "transmit", "internet"): octets})
        assert series(registry) == first  # no exported total dropped (the book holds the carry), nothing lost
        expected = send_all(topology)
        before_restart = series(registry)
        assert delta(before_restart, first) == complete(expected)  # and new traffic adds exactly on top
        expected[("node", "transmit", "internet", "pod", "packets")] += packets
        expected[("node", "transmit", "internet", "pod", "bytes")] += octets
    finally:
        engine.close()

    # The next restart sums the kernel's raw values: the node totals fall back to what the kernel counted since the
    # migration (the carry held in memory only is lost; Prometheus reads it as a counter reset). The pod series were
    # carried in the sets' elements, which the kernel kept: they continue exactly.
    restarted, restarted_registry = make_engine(layout="iptables", backend=mode)
    restarted.sync(pods())
    after = series(restarted_registry)
    assert node_series(after) == node_series(complete(expected))
    assert all(after[k] == before_restart[k] - carried[k] for k in node_series(carried))  # exactly the carry
    assert pod_series(after) == pod_series(before_restart)
    restarted.close()
