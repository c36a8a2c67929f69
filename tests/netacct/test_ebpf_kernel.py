"""The eBPF objects on a real kernel: real packets through the node namespace, counted by the agent's own
programs, match netfilter's IP-level bytes exactly for every node series and every pod role, both families;
counting goes on with no process holding an fd; the objects come back from their pins; removal leaves nothing."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import time
from collections import Counter

import pytest

from agent.config.netacct import NetacctConfig
from agent.host import bpf, bpf_tc
from agent.netacct.ebpf import program
from agent.netacct.ebpf.objects import Objects
from tests.netacct import netns
from tests.netacct.netns import OTHER_POD4, OTHER_POD6, POD4, POD6
from tests.netacct.test_e2e_counts import Series, complete, send_all

DIRECTION = {"in": "receive", "out": "transmit"}
ROLE = {"rx-inet": ("receive", "internet"), "tx-inet": ("transmit", "internet"),
        "rx-clus": ("receive", "cluster"), "tx-clus": ("transmit", "cluster")}
OWNERS = {POD4: ("team-a", "trainer-0"), POD6: ("team-a", "trainer-0"),
          OTHER_POD4: ("other", "pod"), OTHER_POD6: ("other", "pod")}


def _objects(topo: netns.Topology, path: str, tcx: bool | None) -> Objects:
    objects = Objects(path, netns=topo.node, tcx=tcx)
    objects.open_maps(create=True)
    entries = {(ipaddress.ip_address(a).packed, role): None for a in OWNERS for role in program.ROLES}
    objects.set_pods(entries)
    objects.sync_hooks((4, 6), NetacctConfig().internal_networks())
    return objects


def _series(objects: Objects) -> Series:
    """What the maps say, keyed as tests/netacct/test_e2e_counts.series keys the scrape."""
    read = objects.read((4, 6))
    out: Series = Counter()
    for keys in read.node.values():
        for key, (packets, octets) in keys.items():
            fields = dict(part.split("=") for part in key.split())
            traffic, way = fields["traffic"].split("-")
            out[("node", DIRECTION[way], traffic, fields["scope"], "packets")] += packets
            out[("node", DIRECTION[way], traffic, fields["scope"], "bytes")] += octets
    for (address, role), (_, octets) in read.pods.items():
        owner = OWNERS[str(ipaddress.ip_address(address))]
        out[("pod", *owner, *ROLE[role])] += octets
    return out


def _attached_programs(topo: netns.Topology, tcx: bool) -> list[int]:
    """The ids of the programs on every hook of the node's interfaces (tcx query, or the filters' programs)."""
    ids = []
    for iface in bpf_tc.interfaces(topo.node):
        if tcx:
            with netns.entered(topo.node):
                for attach in (bpf.TCX_INGRESS, bpf.TCX_EGRESS):
                    ids += bpf.prog_query(iface.index, attach)[0]
        else:
            for direction in ("ingress", "egress"):
                shown = json.loads(netns.sh("tc", "-j", "filter", "show", "dev", iface.name, direction, ns=topo.node))
                ids += [f["options"]["prog"]["id"] for f in shown if f.get("kind") == "bpf" and "options" in f]
    return ids


def _gone_for_bpftool(map_ids: list[int], prog_ids: list[int]) -> None:
    """bpftool finds none of these maps and programs (freed once the last reference went: allow a moment)."""
    if shutil.which("bpftool") is None:
        pytest.skip("bpftool is not installed (apt-get install -y bpftool)")
    deadline = time.monotonic() + 5
    while True:
        left = [f"map {i}" for i in map_ids if netns.sh("bpftool", "map", "show", "id", str(i), check=False)]
        left += [f"prog {i}" for i in prog_ids if netns.sh("bpftool", "prog", "show", "id", str(i), check=False)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []


def _expected(sent: Series) -> Series:
    full = complete(sent, hostile_zero=False)
    full.update({("pod", "other", "pod", d, t): 0 for d, t in ROLE.values()})
    return full


@pytest.mark.parametrize("tcx", [True, False], ids=["tcx", "clsact"])
def test_exact_bytes_both_families_every_series(bpffs: str, tcx: bool) -> None:
    topo = netns.build_or_skip()
    try:
        objects = _objects(topo, bpffs, tcx)
        expected = _expected(send_all(topo))
        assert _series(objects) == expected
        if tcx:
            ifindex = next(i.index for i in bpf_tc.interfaces(topo.node) if i.name == "v-node-pod")
            with netns.entered(topo.node):
                progs, links = bpf.prog_query(ifindex, bpf.TCX_INGRESS)
            assert len(progs) == 1 and len(links) == 1
        # no fd held anywhere: the pins (tcx) or the filters (clsact) keep counting
        objects.close()
        again = send_all(topo)
        reopened = Objects(bpffs, netns=topo.node, tcx=tcx)
        assert reopened.open_maps(create=False)
        assert reopened.sync_hooks((4, 6), NetacctConfig().internal_networks()) == []  # nothing to change
        total = _expected(send_all(topo))
        total.update(again)
        total.update(expected)
        assert _series(reopened) == total
        map_ids = [bpf.map_info(fd).id for fd in reopened.maps.values()]
        prog_ids = _attached_programs(topo, tcx)
        assert len(prog_ids) == 4  # v-node-pod and v-node-inet, ingress and egress
        removed = reopened.remove()
        assert any(r.startswith("map") for r in removed)
        assert reopened.pins() == []
        for iface in bpf_tc.interfaces(topo.node):
            assert bpf_tc.cls_attached(iface.index, "ingress", topo.node) is None
            with netns.entered(topo.node):
                assert bpf.prog_query(iface.index, bpf.TCX_INGRESS) == ([], [])
                assert bpf.prog_query(iface.index, bpf.TCX_EGRESS) == ([], [])
        _gone_for_bpftool(map_ids, prog_ids)
    finally:
        netns.destroy(topo)


def test_a_rejected_program_surfaces_the_verifier_lines() -> None:
    if os.geteuid() != 0:
        pytest.skip("loading programs needs root")
    a = program.asm.Asm()
    a.ldx(8, program.R0, program.R1, 0)  # an 8-byte read of __sk_buff.len: not a valid context access
    a.exit()
    with pytest.raises(bpf.VerifierError) as caught:
        bpf.prog_load(bpf.PROG_SCHED_CLS, a.assemble({}), "gna_bad", bpf.TCX_INGRESS)
    assert "invalid bpf_context access" in caught.value.log


NAT = "".join(f"""table {t} gna_test_nat {{
  chain post {{
    type nat hook postrouting priority 100;
    oifname "v-node-inet" {t} saddr {net} masquerade
  }}
}}
""" for t, net in (("ip", "10.244.1.0/24"), ("ip6", "fd00:244:1::/64")))


def _conversation(topo: netns.Topology, pod: str, peer: str, sent: tuple[int, int], replies: tuple[int, int]) -> Series:
    """The pod sends to the peer, the peer answers whoever it saw (the node, once masqueraded); the increase of
    each series the nft layout's forward chains would count (they see the pod's address both ways)."""
    family = 6 if ":" in peer else 4
    with netns.udp_socket(topo.pod, family, pod) as tx, netns.udp_socket(topo.inet, family, peer) as rx:
        for _ in range(sent[0]):
            tx.sendto(b"\xa5" * sent[1], (peer, rx.getsockname()[1]))
        seen = None
        for _ in range(sent[0]):
            seen = rx.recvfrom(65535)[1]
        assert seen is not None and seen[0] != pod  # masqueraded
        for _ in range(replies[0]):
            rx.sendto(b"\x5a" * replies[1], seen[:2])
        for _ in range(replies[0]):
            tx.recv(65535)
    header = netns.IP_HEADER[family]
    return Counter({("node", "transmit", "internet", "pod", "packets"): sent[0],
                    ("node", "transmit", "internet", "pod", "bytes"): sent[0] * (sent[1] + header),
                    ("node", "receive", "internet", "pod", "packets"): replies[0],
                    ("node", "receive", "internet", "pod", "bytes"): replies[0] * (replies[1] + header),
                    ("pod", "team-a", "trainer-0", "transmit", "internet"): sent[0] * (sent[1] + header),
                    ("pod", "team-a", "trainer-0", "receive", "internet"): replies[0] * (replies[1] + header)})


def test_masqueraded_pod_traffic_counts_for_the_pod_both_ways(bpffs: str) -> None:
    """Replies to masqueraded pod traffic arrive addressed to the node: conntrack de-NATs and routing forwards them,
    so they are the pod's internet receive bytes (as netfilter's forward hook sees them), not host input."""
    topo = netns.build_or_skip()
    try:
        netns.sh("nft", "-f", "-", ns=topo.node, stdin=NAT)
        objects = _objects(topo, bpffs, None)
        expected = _conversation(topo, POD4, netns.INET4, (6, 300), (4, 900))
        expected.update(_conversation(topo, POD6, netns.INET6, (3, 200), (5, 700)))
        assert _series(objects) == _expected(expected)
        objects.remove()
    finally:
        netns.destroy(topo)
