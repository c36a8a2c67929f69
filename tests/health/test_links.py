"""NIC link health: what counts as down, the netlink and sysfs ports, and a link flap through the service."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.health.links import link_problem
from agent.host.links import NetdevState, NetlinkLinkPort, SysfsLinkPort
from agent.host.nvml import SimulatedNvml
from agent.simulate.node import SimulatedNode
from agent.topology.load import load_topology
from agent.topology.model import Nic, Topology
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.health.conftest import fast_config


def _pf(topology: Topology, index: int = 0) -> Nic:
    return topology.rdma_nics[index]


@pytest.mark.parametrize(("netdev", "ports", "problem"), [
    (NetdevState("up", True), {1: "ACTIVE"}, None),
    (NetdevState("unknown", True), {1: "ACTIVE"}, None),  # drivers without operstate: carrier decides
    (NetdevState("up", False), {1: "ACTIVE"}, "ibp24s0 no carrier"),
    (NetdevState("lowerlayerdown", None), {1: "ACTIVE"}, "ibp24s0 lowerlayerdown"),
    (NetdevState("up", True), {1: "INIT"}, "mlx5_0 port 1 INIT"),
    (NetdevState("down", False), {1: "DOWN"}, "ibp24s0 no carrier, mlx5_0 port 1 DOWN"),
    (None, {}, None),  # nothing known (netdev moved to another namespace): no verdict
])
def test_link_problem(dgx_root: Path, netdev: NetdevState | None, ports: dict[int, str],
                      problem: str | None) -> None:
    nic = _pf(load_topology(dgx_root, SimulatedNvml({}).gpu_uuids()))
    netdevs = {nic.netdevs[0]: netdev} if netdev else {}
    assert link_problem(nic, netdevs, ports) == problem


def test_sysfs_port_reads_the_simulated_tree(dgx_root: Path) -> None:
    port = SysfsLinkPort(dgx_root)
    assert port.netdev_states()["ibp24s0"] == NetdevState("up", True)
    assert port.rdma_port_states("mlx5_0") == {1: "ACTIVE"}
    assert port.rdma_port_states("mlx5_99") == {}


def test_netlink_port_reads_this_host() -> None:
    states = NetlinkLinkPort("/sys").netdev_states()
    assert "lo" in states  # every network namespace has one


def _set_link(node: SimulatedNode, nic: Nic, up: bool) -> None:
    netdev = node.sysfs_root / "class" / "net" / nic.netdevs[0]
    (netdev / "operstate").write_text("up\n" if up else "down\n")
    (netdev / "carrier").write_text("1\n" if up else "0\n")
    port = node.sysfs_root / "class" / "infiniband" / (nic.rdma or "") / "ports" / "1"
    (port / "state").write_text("4: ACTIVE\n" if up else "1: DOWN\n")


async def test_link_flap_marks_the_pfs_vfs_unhealthy_and_back(writable_node: SimulatedNode, kmsg_file,
                                                              start_service) -> None:
    node = writable_node
    running = await start_service(node, fast_config(kmsg_file))
    topology = node.topology()
    nic, other = _pf(topology, 2), _pf(topology, 3)
    vfs = {vf.bus_id for vf in nic.vfs}
    assert len(vfs) == 8
    _set_link(node, nic, up=False)
    await until(lambda: all(running.health().get(vf) is False for vf in vfs))
    assert running.health()[nic.bus_id] is False
    assert not {vf.bus_id for vf in other.vfs} & set(running.health())  # only that PF's VFs
    assert running.service.verdict.verdict == "degraded"
    assert "link down" in running.service.verdict.reasons[0]
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_nic_link_up", {"pci_bus_id": nic.bus_id, "netdev": nic.netdevs[0],
                                              "rdma": nic.rdma}) == 0
    assert get("gpu_node_agent_device_healthy", {"resource": "nic_vf", "device": nic.vfs[0].bus_id}) == 0
    _set_link(node, nic, up=True)
    await until(lambda: all(running.health().get(vf) is True for vf in vfs))
    assert running.service.verdict.verdict == "healthy"
    assert get("gpu_node_agent_device_healthy", {"resource": "nic_vf", "device": nic.vfs[0].bus_id}) == 1


async def test_link_down_action_is_configurable(writable_node: SimulatedNode, kmsg_file, start_service) -> None:
    node = writable_node
    running = await start_service(node, fast_config(kmsg_file, link_down_action="cordon"))
    nic = _pf(node.topology(), 0)
    _set_link(node, nic, up=False)
    await until(lambda: running.service.verdict.verdict == "cordon")


async def test_an_rdma_port_change_seen_by_the_counter_pass_nudges_the_link_check(
        writable_node: SimulatedNode, kmsg_file, start_service) -> None:
    """sysfs sends no event for an RDMA port state: the NIC counter pass (every 0.05 fake seconds here) notices
    the change and the link check reads again long before its 30 s safety poll."""
    node, clock = writable_node, FakeClock()
    start = clock.monotonic()
    running = await start_service(node, fast_config(kmsg_file, link_check_interval_seconds=30,
                                                    nic_counter_interval_seconds=0.05),
                                  link_port=SysfsLinkPort(node.sysfs_root, poll_interval=3600), clock=clock)
    nic = _pf(node.topology(), 1)
    port = node.sysfs_root / "class" / "infiniband" / (nic.rdma or "") / "ports" / "1"
    (port / "state").write_text("1: DOWN\n")
    await until(lambda: running.service.verdict.verdict == "degraded", "port DOWN judged", clock=clock, step=0.05)
    assert f"{nic.rdma} port 1 DOWN" in running.service.verdict.reasons[0]
    assert all(running.health().get(vf.bus_id) is False for vf in nic.vfs)
    assert clock.monotonic() - start < 30
