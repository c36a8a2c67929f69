"""Set plans: names from constants only, members from validated addresses, diffs both ways."""

from __future__ import annotations

import ipaddress
import socket

from agent.host.ipset_netlink import FLAG_WITH_COUNTERS, SetDump
from agent.netacct import ipsets

NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "fd00::/8", "0.0.0.0/0")]


def member(ip: str) -> ipsets.Member:
    """A plain-address member."""
    packed = ipaddress.ip_address(ip).packed
    return packed, len(packed) * 8


def test_names() -> None:
    assert ipsets.set_name("rx-inet", 4) == "gna-rx-inet4"
    names = ipsets.all_names((4, 6))
    assert len(names) == 10 and all(len(n) <= 31 and n.startswith("gna-") for n in names)
    assert ipsets.is_ours("gna-internal6") and not ipsets.is_ours("gna-something") and not ipsets.is_ours("KUBE")


def test_internal_members_split_a_default_route() -> None:
    got = {ipsets.member_text(m, ipsets.INTERNAL) for m in ipsets.internal_members(NETS, 4)}
    assert got == {"10.0.0.0/8", "0.0.0.0/1", "128.0.0.0/1"}
    assert {ipsets.member_text(m, ipsets.INTERNAL) for m in ipsets.internal_members(NETS, 6)} == {"fd00::/8"}


def test_plan_creates_then_diffs() -> None:
    pods = {4: {member("10.1.2.3")}, 6: {member("fd00::3")}}
    plan = ipsets.plan({}, pods, NETS, (4, 6))
    lines = plan.payload.splitlines()
    assert "create gna-rx-inet4 hash:ip family inet counters" in lines
    assert "create gna-internal6 hash:net family inet6" in lines
    assert "add gna-tx-clus6 fd00::3" in lines and "add gna-internal4 0.0.0.0/1" in lines
    assert lines.index("create gna-rx-inet4 hash:ip family inet counters") < lines.index("add gna-rx-inet4 10.1.2.3")

    current = {name: SetDump(name) for name in ipsets.all_names((4,))}
    current["gna-rx-inet4"].members = {member("10.1.2.3"): (1, 2), member("10.9.9.9"): (3, 4)}
    plan = ipsets.plan(current, {4: {member("10.1.2.3"), member("10.1.2.4")}}, NETS[:1], (4,))
    lines = plan.payload.splitlines()
    assert "del gna-rx-inet4 10.9.9.9" in lines and "add gna-rx-inet4 10.1.2.4" in lines
    assert "add gna-rx-inet4 10.1.2.3" not in lines and not any(line.startswith("create") for line in lines)
    assert plan.removed == {"gna-rx-inet4": {member("10.9.9.9")}}


def test_compatible() -> None:
    good = SetDump("gna-rx-inet4", "hash:ip", socket.AF_INET, FLAG_WITH_COUNTERS)
    assert ipsets.compatible("rx-inet", 4, good)
    assert not ipsets.compatible("rx-inet", 4, SetDump("gna-rx-inet4", "hash:ip", socket.AF_INET, 0))
    assert not ipsets.compatible("rx-inet", 6, good)
    assert ipsets.compatible("internal", 6, SetDump("gna-internal6", "hash:net", socket.AF_INET6, 0))


def test_destroy_only_ours() -> None:
    payload = ipsets.destroy_payload(["gna-rx-inet4", "KUBE-CLUSTER-IP", "cali40all-hosts", "gna-internal6"])
    assert payload == "flush gna-internal6\ndestroy gna-internal6\nflush gna-rx-inet4\ndestroy gna-rx-inet4\n"
