"""The native layout's plan, without a kernel: what one transaction holds, and that a matching table needs none."""

from __future__ import annotations

import ipaddress

from agent.host.nft_netlink import SET_INTERVAL, ChainInfo, Elements, SetInfo, _ranges
from agent.netacct import ipsets, nft_layout
from agent.netacct.nft_layout import NftState

NETWORKS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "11.0.0.0/8", "10.1.0.0/16", "fd00::/8")]
POD = ipaddress.ip_address("10.244.1.2").packed
MEMBERS = {4: {(POD, 32)}, 6: set[ipsets.Member]()}


def matching_state() -> NftState:
    """The table exactly as the plan wants it (what a restart finds)."""
    state = NftState(sets={})
    assert state.sets is not None
    for name, (family, role, key_type) in nft_layout.desired_sets((4, 6)).items():
        internal = role == ipsets.INTERNAL
        state.sets[name] = SetInfo(name, SET_INTERVAL if internal else 0, key_type, counter=not internal)
        state.elements[name] = Elements(ranges=nft_layout.internal_ranges(NETWORKS, family)) if internal else \
            Elements(counted={m[0]: (3, 300) for m in MEMBERS[family]})
    for chain, rules in nft_layout.desired_rules(nft_layout.classifiers(NETWORKS, MEMBERS, (4, 6))).items():
        base = chain in nft_layout.HOOKS  # the kernel reports no hook, priority or type for a regular chain
        state.chains[chain] = ChainInfo(chain, nft_layout.HOOKS.get(chain), nft_layout.PRIORITY if base else None,
                                        "filter" if base else "", [rule.comment for rule in rules])
    state.counters = dict.fromkeys(nft_layout.counter_keys((4, 6)), (1, 2))
    return state


def test_an_empty_namespace_gets_the_whole_table_in_one_transaction() -> None:
    plan = nft_layout.plan(NftState(sets=None), MEMBERS, NETWORKS, (4, 6))
    lines = plan.payload.splitlines()
    assert lines[0] == f"add table inet {nft_layout.TABLE}"
    assert f"add element inet {nft_layout.TABLE} internal4 {{ 10.0.0.0/7 }}" in lines  # collapsed, no overlap
    assert f"add element inet {nft_layout.TABLE} rx_inet4 {{ 10.244.1.2 }}" in lines
    assert sum(line.startswith("add counter") for line in lines) == 16
    assert sum(line.startswith("add chain") and "priority -300;" in line for line in lines) == 3
    assert not plan.rebuilt and plan.rewritten_chains[-3:] == ["input", "output", "forward"]  # base chains last
    assert lines.index(f"add chain inet {nft_layout.TABLE} fwd4_from_cluster") < \
        lines.index(next(line for line in lines if "goto fwd4_from_cluster" in line))


def test_a_matching_table_needs_no_transaction() -> None:
    assert nft_layout.plan(matching_state(), MEMBERS, NETWORKS, (4, 6)).payload == ""


def test_only_what_differs_is_changed() -> None:
    state = matching_state()
    state.chains["fwd4_internet_cluster"].comments.pop()
    other = ipaddress.ip_address("10.244.1.9").packed
    plan = nft_layout.plan(state, {4: {(other, 32)}}, NETWORKS, (4, 6))
    lines = plan.payload.splitlines()
    assert f"flush chain inet {nft_layout.TABLE} fwd4_internet_cluster" in lines
    assert plan.rewritten_chains == ["fwd4_internet_cluster"]
    assert f"delete element inet {nft_layout.TABLE} rx_inet4 {{ 10.244.1.2 }}" in lines
    assert f"add element inet {nft_layout.TABLE} tx_clus4 {{ 10.244.1.9 }}" in lines
    assert not any("counter " in line and line.startswith("add counter") for line in lines)  # counters kept
    assert not any(" set " in line for line in lines)


def test_an_incompatible_set_or_chain_rebuilds_the_table() -> None:
    state = matching_state()
    assert state.sets is not None
    state.sets["rx_inet4"].counter = False
    plan = nft_layout.plan(state, MEMBERS, NETWORKS, (4, 6))
    assert plan.rebuilt and plan.payload.startswith(f"delete table inet {nft_layout.TABLE}\n")
    state = matching_state()
    state.chains["input"].priority = 0
    assert nft_layout.plan(state, MEMBERS, NETWORKS, (4, 6)).rebuilt


def test_turning_ipv6_off_deletes_its_objects_after_the_rules() -> None:
    lines = nft_layout.plan(matching_state(), MEMBERS, NETWORKS, (4,)).payload.splitlines()
    assert f"delete set inet {nft_layout.TABLE} rx_inet6" in lines
    assert f"delete counter inet {nft_layout.TABLE} cluster_in_host6" in lines
    assert max(i for i, line in enumerate(lines) if line.startswith("add rule")) < \
        min(i for i, line in enumerate(lines) if line.startswith("delete"))


def test_interval_elements_become_merged_ranges() -> None:
    # The kernel lists a start element per range and an end element (flag 1) one past its last address;
    # adjacent ranges are joined, and a range without an end runs to the top of the address space.
    bounds = [(10 << 24, 1, 32), (11 << 24, 0, 32), (11 << 24, 1, 32), (12 << 24, 0, 32), (200 << 24, 1, 32)]
    assert _ranges(bounds) == [(10 << 24, 12 << 24), (200 << 24, 1 << 32)]
    assert nft_layout.internal_ranges(NETWORKS, 4) == [(10 << 24, 12 << 24)]


def rule_texts(networks: list[nft_layout.Network], members: dict[int, set[ipsets.Member]]) -> dict[str, list[str]]:
    shape = nft_layout.classifiers(networks, members, (4, 6))
    return {chain: [rule.text for rule in rules] for chain, rules in nft_layout.desired_rules(shape).items()}


def test_a_few_internal_cidrs_are_compared_inline_and_many_go_through_the_set() -> None:
    few = rule_texts(NETWORKS, MEMBERS)
    assert [t for t in few["forward"] if "goto fwd4_from_cluster" in t] == \
        ["ip saddr 10.0.0.0/7 goto fwd4_from_cluster"]  # collapsed: 10/8 + 11/8 (+ 10.1/16 inside)
    assert "ip6 daddr fd00::/8 goto fwd6_cluster_cluster" in few["fwd6_from_cluster"]
    assert not any("@internal" in t for texts in few.values() for t in texts)
    many = [ipaddress.ip_network(f"10.{i * 2}.0.0/16") for i in range(nft_layout.INLINE_LIMIT + 1)]
    texts = rule_texts(many, MEMBERS)
    assert [t for t in texts["forward"] if "goto fwd4_from_cluster" in t] == \
        ["ip saddr @internal4 goto fwd4_from_cluster"]
    assert any("ip daddr @internal4" in t for t in texts["output"])


def test_a_pod_outside_the_internal_cidrs_brings_the_internet_side_lookups_back() -> None:
    inside = rule_texts(NETWORKS, MEMBERS)
    assert not any("@rx_clus4" in t for t in inside["fwd4_cluster_internet"])  # an internet address is no pod's
    assert not any("@tx_clus4" in t for t in inside["fwd4_internet_cluster"])
    assert inside["fwd4_internet_internet"] == ['counter name "internet_in_pod4"', 'counter name "internet_out_pod4"']
    public = ipaddress.ip_address("198.51.100.7").packed
    outside = rule_texts(NETWORKS, {4: {*MEMBERS[4], (public, 32)}, 6: set()})
    assert any("@rx_clus4" in t for t in outside["fwd4_cluster_internet"])
    assert any("@tx_clus4" in t for t in outside["fwd4_internet_cluster"])
    assert any("@rx_inet4" in t for t in outside["fwd4_internet_internet"])
    assert inside["fwd6_cluster_internet"] == outside["fwd6_cluster_internet"]  # per family
