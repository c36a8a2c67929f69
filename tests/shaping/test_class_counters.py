"""The scrape's read against the kernel: one class dump per interface asked for, only our limited class, and
nothing for an interface without our shaper or one that is gone."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import pytest

from agent.host.tc_netlink import NetlinkTc
from tests.shaping import netns


@pytest.fixture
def namespace() -> Iterator[str]:
    reason = netns.missing_prerequisite()
    if reason:
        pytest.skip(reason)
    name = f"gns-cc-{uuid.uuid4().hex[:8]}"
    peer = f"{name}-p"
    netns.sh("ip", "netns", "add", name)
    netns.sh("ip", "netns", "add", peer)
    try:  # d0 and d1 in `name`, their peers in `peer`; 10.9.0.1 -> 10.9.0.2 leaves through d0
        for i in (0, 1):
            netns.sh("ip", "link", "add", f"d{i}", "type", "veth", "peer", "name", f"p{i}", "netns", peer, ns=name)
            netns.sh("ip", "link", "set", f"d{i}", "up", ns=name)
            netns.sh("ip", "link", "set", f"p{i}", "up", ns=peer)
        netns.sh("ip", "addr", "add", "10.9.0.1/24", "dev", "d0", ns=name)
        netns.sh("ip", "addr", "add", "10.9.0.2/24", "dev", "p0", ns=peer)
        yield name
    finally:
        netns.sh("ip", "netns", "del", name, check=False)
        netns.sh("ip", "netns", "del", peer, check=False)


def test_only_our_limited_classes_of_the_interfaces_asked_for(namespace: str):
    tc = NetlinkTc(namespace)
    try:
        d0, d1 = (tc._ipr.link_lookup(ifname=dev)[0] for dev in ("d0", "d1"))
        tc.shape_download(d0, 40_000_000, [])
        netns.sh("tc", "qdisc", "add", "dev", "d1", "root", "handle", "1:", "htb", ns=namespace)  # not ours
        netns.sh("tc", "class", "add", "dev", "d1", "parent", "1:", "classid", "1:1", "htb", "rate", "1mbit",
                 ns=namespace)
        send = ("import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "for _ in range(5): s.sendto(b'x' * 1000, ('10.9.0.2', 9)); time.sleep(0.01)")
        netns.sh(sys.executable, "-c", send, ns=namespace)
        read = tc.counters([d0, d1, 999_999])
        assert set(read) == {d0}
        assert read[d0].bytes >= 5 * 1000 and read[d0].drops == 0
        assert read[d0] == tc.read().counters[d0]  # the leaf counts what the class does
        assert tc.counters([d1]) == {} and tc.counters([]) == {}
        tc.unshape_download(d0)
        assert tc.counters([d0]) == {}
    finally:
        tc.close()
