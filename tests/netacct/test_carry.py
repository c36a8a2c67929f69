"""A migration's carry, without a kernel: the book's totals split over the new layout's counters, the payloads
that preload them (fresh objects only), and the book arithmetic across the migration and a later restart."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from agent.host.ipset_netlink import SetDump
from agent.netacct import carry, ipsets, nft_layout, rules
from agent.netacct.carry import Carry, OldRaw
from agent.netacct.counters import CounterBook
from agent.netacct.nft_layout import NftState
from tests.netacct.test_nft_layout import MEMBERS, NETWORKS, matching_state

KEY = "traffic=internet-in scope=host"
KEYS = [key for _, key in nft_layout.counter_keys((4,)).values()]
POD = ("team-a", "trainer-0")
V4, V6 = ipaddress.ip_address("10.244.1.2").packed, ipaddress.ip_address("fd00::2").packed
M4, M6 = (V4, 32), (V6, 128)

counts = st.tuples(st.integers(0, 10**12), st.integers(0, 10**15))


@given(counts, st.lists(counts, min_size=1, max_size=4))
def test_split_adds_up_keeps_raw_values_that_fit_and_never_goes_negative(total: tuple[int, int],
                                                                         parts: list[tuple[int, int]]) -> None:
    out = carry.split(total, parts)
    assert len(out) == len(parts)
    for c in (0, 1):
        assert sum(p[c] for p in out) == total[c] and all(p[c] >= 0 for p in out)
        if sum(p[c] for p in parts[1:]) <= total[c]:
            assert [p[c] for p in out[1:]] == [p[c] for p in parts[1:]]


def migrated_book() -> tuple[CounterBook, OldRaw]:
    """The book of an agent that just started on the old layout and read it a final time."""
    book = CounterBook()
    book.set_pods({V4: POD, V6: POD})
    old = OldRaw(rules={4: {KEY: (3, 300)}, 6: {KEY: (2, 200)}},
                 elements={("rx-inet", 4): {M4: (5, 500)}, ("rx-inet", 6): {M6: (1, 100)}})
    for family, raw in old.rules.items():
        book.observe_rules(family, raw)
    book.observe_set("gna-rx-inet4", "rx-inet", old.elements[("rx-inet", 4)])
    book.observe_set("gna-rx-inet6", "rx-inet", old.elements[("rx-inet", 6)])
    return book, old


def test_a_fresh_migration_carries_each_old_raw_value_into_its_counterpart() -> None:
    book, old = migrated_book()
    planned = carry.plan(book, old, keys=KEYS, families=(4, 6), members={4: {M4}, 6: {M6}},
                         owners={V4: POD, V6: POD})
    assert planned.rules == {4: {KEY: (3, 300)}, 6: {KEY: (2, 200)}}
    assert planned.elements == {("rx-inet", 4): {M4: (5, 500)}, ("rx-inet", 6): {M6: (1, 100)}}
    only_v4 = carry.plan(book, old, keys=KEYS, families=(4, 6), members={4: {M4}, 6: {M6}},
                         owners={V4: POD, V6: POD}, rule_families=(4,))
    assert only_v4.rules == {4: {KEY: (5, 500)}}  # the IPv6 rule's share goes to the IPv4 rule


def test_totals_the_kernel_never_held_are_carried_too() -> None:
    # The book holds more than the old raw values (a rule rewritten earlier): the split still adds up to the
    # exported total; IPv6 turned off at the migration: its share goes to the IPv4 objects.
    book, old = migrated_book()
    book.rules_restarted(4, [KEY])
    book.observe_rules(4, {KEY: (1, 10)})
    planned = carry.plan(book, old, keys=KEYS, families=(4,), members={4: {M4}}, owners={V4: POD, V6: POD})
    assert planned.rules == {4: {KEY: (6, 510)}}
    assert planned.elements == {("rx-inet", 4): {M4: (6, 600)}}


def test_book_arithmetic_across_a_migration_and_a_restart() -> None:
    book, old = migrated_book()
    planned = carry.plan(book, old, keys=KEYS, families=(4, 6), members={4: {M4}, 6: {M6}},
                         owners={V4: POD, V6: POD})
    exported = (book.rule_totals(), book.pod_totals())
    for family, values in planned.rules.items():  # the new layout was created holding the carry
        book.rules_created_with(f"nft{family}", values)
    for (role, family), values in planned.elements.items():
        book.elements_created_with(nft_layout.set_name(role, family), values)
    book.forget([4, 6], ipsets.all_names((4, 6)))  # the old layout is gone
    kernel = {"nft4": (3 + 7, 300 + 70), "nft6": (2, 200)}  # 7 new IPv4 packets
    elements = {"rx_inet4": {M4: (5 + 7, 500 + 70)}, "rx_inet6": {M6: (1, 100)}}

    def feed(target: CounterBook) -> None:
        for source, value in kernel.items():
            target.observe_rules(source, {KEY: value})
        for name, raw in elements.items():
            target.observe_set(name, "rx-inet", raw)

    assert (book.rule_totals(), book.pod_totals()) == exported  # nothing jumps at the migration
    feed(book)
    assert book.rule_totals()[KEY] == (12, 570) and book.pod_totals()[POD]["rx-inet"] == (13, 670)
    restarted = CounterBook()  # a new agent process over the same kernel state
    restarted.set_pods({V4: POD, V6: POD})
    feed(restarted)
    assert restarted.rule_totals()[KEY] == book.rule_totals()[KEY]
    assert restarted.pod_totals() == book.pod_totals()


def test_the_nft_plan_preloads_a_fresh_table_only() -> None:
    planned = Carry(rules={4: {KEY: (3, 300)}}, elements={("rx-inet", 4): {M4: (5, 500)}})
    lines = nft_layout.plan(NftState(sets=None), MEMBERS, NETWORKS, (4, 6), planned).payload.splitlines()
    table = nft_layout.TABLE
    assert f"add counter inet {table} internet_in_host4 {{ packets 3 bytes 300 }}" in lines
    assert f"add counter inet {table} internet_in_host6" in lines
    assert f"add element inet {table} rx_inet4 {{ 10.244.1.2 counter packets 5 bytes 500 }}" in lines
    assert f"add element inet {table} tx_inet4 {{ 10.244.1.2 }}" in lines
    assert f"add counter inet {table} {nft_layout.CARRY_MARKER}" in lines
    adopted = matching_state()
    assert nft_layout.plan(adopted, MEMBERS, NETWORKS, (4, 6), planned).payload == ""  # keeps its own counts


def test_the_iptables_plans_preload_fresh_chains_and_sets_only() -> None:
    planned = rules.plan(rules.Mangle(), 4, {KEY: (3, 300)})
    assert planned.carried == {KEY: (3, 300)}
    lines = planned.payloads[0].splitlines()
    assert sum(line.startswith("[3:300] -A GNA-NETACCT-IN ") and KEY in line for line in lines) == 1
    assert sum(line.startswith("[") for line in lines) == 1
    existing = rules.parse(planned.payloads[0])
    assert rules.plan(existing, 4, {KEY: (9, 900)}).carried == {}  # an existing chain keeps its counts
    assert rules.MARKER in rules.marker_payload(create=True)
    marked = rules.parse(f"*mangle\n:{rules.MARKER} - [0:0]\nCOMMIT\n")
    assert any(f"-X {rules.MARKER}" in p for p in rules.plan(marked, 4).payloads)  # stale outside a migration
    assert not any(rules.MARKER in p for p in rules.plan(marked, 4, {}).payloads)  # kept during one
    both = rules.parse(f"*mangle\n:{rules.MARKER} - [0:0]\n:{rules.CARRIED} - [0:0]\nCOMMIT\n")
    assert any(f"-X {rules.CARRIED}" in p for p in rules.plan(both, 4).payloads)  # the complete-install marker too
    assert not any(rules.CARRIED in p for p in rules.plan(both, 4, {}).payloads)
    assert rules.marker_payload(create=False, chains=rules.MARKERS).count("-X ") == 2

    sets = ipsets.plan({}, {4: {M4}}, NETWORKS, (4,), {("rx-inet", 4): {M4: (5, 500)}})
    assert "add gna-rx-inet4 10.244.1.2 packets 5 bytes 500" in sets.payload.splitlines()
    assert "add gna-tx-inet4 10.244.1.2" in sets.payload.splitlines()
    assert sets.carried == {"gna-rx-inet4": {M4: (5, 500)}}
    current = {name: SetDump(name) for name in ipsets.all_names((4,))}
    again = ipsets.plan(current, {4: {M4}}, NETWORKS, (4,), {("rx-inet", 4): {M4: (5, 500)}})
    assert "packets" not in again.payload and again.carried == {}  # -exist would overwrite an element's counter
