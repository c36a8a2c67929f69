"""The counter book: totals are monotonic, exact when restarts are announced, and follow pod ownership."""

from __future__ import annotations

import ipaddress

from hypothesis import given
from hypothesis import strategies as st

from agent.netacct.counters import CounterBook

KEY = "traffic=internet-in scope=host"
IP = ipaddress.ip_address("10.1.2.3").packed
MEMBER = (IP, 32)

events = st.lists(st.one_of(st.tuples(st.just("traffic"), st.integers(1, 10_000)), st.just(("observe", 0)),
                            st.just(("rewrite", 0)), st.just(("external-reset", 0))), max_size=60)


@given(events)
def test_rule_totals_are_exact_with_announced_restarts_and_never_decrease(ops: list[tuple[str, int]]) -> None:
    book, raw, sent, seen = CounterBook(), 0, 0, 0
    announced_only = all(op != "external-reset" for op, _ in ops)
    for op, amount in ops:
        if op == "traffic":
            raw, sent = raw + amount, sent + amount
        elif op == "rewrite":  # the engine reads, rewrites the chain, and announces it
            book.observe_rules(4, {KEY: (raw, raw)})
            raw = 0
            book.rules_restarted(4, [KEY])
        elif op == "external-reset":  # someone else flushed it: unannounced
            raw = 0
        if op == "observe":
            book.observe_rules(4, {KEY: (raw, raw)})
        total = book.rule_totals().get(KEY, (0, 0))[1]
        assert total >= seen
        seen = total
    book.observe_rules(4, {KEY: (raw, raw)})
    total = book.rule_totals()[KEY][1]
    assert total <= sent
    if announced_only:
        assert total == sent


def test_families_are_summed_and_vanished_rules_count_from_zero_again() -> None:
    book = CounterBook()
    book.observe_rules(4, {KEY: (1, 100)})
    book.observe_rules(6, {KEY: (2, 200)})
    assert book.rule_totals()[KEY] == (3, 300)
    book.observe_rules(4, {})  # the rule vanished (flushed by someone)
    book.observe_rules(4, {KEY: (1, 50)})  # re-created and already counting
    assert book.rule_totals()[KEY] == (4, 350)


def test_pod_totals_follow_ownership() -> None:
    book = CounterBook()
    book.set_pods({IP: ("ns", "a")})
    book.observe_set("gna-rx-inet4", "rx-inet", {MEMBER: (2, 200)})
    assert book.pod_totals() == {("ns", "a"): {"rx-inet": (2, 200)}}
    book.set_pods({IP: ("ns", "b")})  # the address moved: b counts from here on
    book.observe_set("gna-rx-inet4", "rx-inet", {MEMBER: (3, 350)})
    assert book.pod_totals() == {("ns", "b"): {"rx-inet": (1, 150)}}
    book.set_pods({})
    assert book.pod_totals() == {}


def test_a_restarted_agent_credits_existing_elements_to_their_first_owner() -> None:
    book = CounterBook()
    book.observe_set("gna-tx-clus4", "tx-clus", {MEMBER: (7, 700)})  # before the pod list arrives
    book.set_pods({IP: ("ns", "a")})
    book.observe_set("gna-tx-clus4", "tx-clus", {MEMBER: (8, 800)})
    assert book.pod_totals()[("ns", "a")]["tx-clus"] == (8, 800)


def test_kernel_state_lost_keeps_totals() -> None:
    book = CounterBook()
    book.observe_rules(4, {KEY: (5, 500)})
    book.kernel_state_lost()
    book.observe_rules(4, {KEY: (9, 900)})  # new rule, more than before: all of it is new traffic
    assert book.rule_totals()[KEY] == (14, 1400)
