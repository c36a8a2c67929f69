"""Default-route interfaces from /proc/net, and the pool rule that keeps the node's uplink out of pods."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent.config import DevicePluginConfig
from agent.deviceplugin.pools import build_pools
from agent.simulate.node import simulated_topology
from agent.topology.routes import default_route_interfaces

ROUTE = """Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
ib0\t0000A8C0\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
eth0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
"""
IPV6_ROUTE = (
    "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fe800000000000000000000000000001 "
    "00000400 00000001 00000000 00000003     ib1\n"
    "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 "
    "00000100 00000001 00000000 00000001     ib2\n"
    "00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 "
    "ffffffff 00000001 00000000 00200200       lo\n"
)


def _proc(tmp_path: Path) -> Path:
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "route").write_text(ROUTE)
    (tmp_path / "net" / "ipv6_route").write_text(IPV6_ROUTE)
    return tmp_path


def test_default_routes_of_both_families(tmp_path):
    assert default_route_interfaces(_proc(tmp_path)) == {"eth0", "ib1"}


def test_unreadable_proc_means_no_default_route(tmp_path):
    assert default_route_interfaces(tmp_path / "missing") == frozenset()


def test_this_hosts_proc_is_readable():
    # the real file on the machine running the tests parses without error
    assert isinstance(default_route_interfaces(), frozenset)


def test_a_pf_carrying_the_default_route_is_never_served(tmp_path):
    topology = simulated_topology("vm-flat", tmp_path)  # RDMA NICs without VFs: the PFs themselves are devices
    served = build_pools(topology, DevicePluginConfig()).by_name()["gpunodeagent.io/sriov_rdma"]
    assert "0101:00:00.0" in served.ids
    uplink = dataclasses.replace(topology, default_route_netdevs=frozenset({"ib0"}))
    scan = build_pools(uplink, DevicePluginConfig())
    assert "0101:00:00.0" not in scan.by_name()["gpunodeagent.io/sriov_rdma"].ids
    assert any("default route" in reason for reason in scan.skipped)
