"""Preflight probes: active NVML and link checks on a simulated node, each failing for the right reason."""

from __future__ import annotations

import pytest

from agent.health import probes
from agent.host.links import SysfsLinkPort
from agent.host.nvml import SimulatedNvml
from agent.simulate.node import build_simulated_node


@pytest.fixture
def node(tmp_path):
    return build_simulated_node("pcie-pairs", tmp_path)


def test_a_healthy_node_passes_every_probe(node):
    topology = node.topology()
    current = lambda: topology  # noqa: E731
    for probe in (probes.no_pending_row_remap(node.nvml, current), probes.no_uncorrectable_ecc(node.nvml, current),
                  probes.nic_links_up(SysfsLinkPort(node.sysfs_root), current)):
        ok, detail = probe()
        assert ok, detail


def test_each_memory_fault_fails_its_probe_and_names_the_gpu(node):
    topology = node.topology()
    sick = topology.gpus[3].uuid
    node.nvml.set_memory(sick, remap_pending=True)
    ok, detail = probes.no_pending_row_remap(node.nvml, lambda: topology)()
    assert not ok and sick in detail and "pending" in detail
    assert probes.no_uncorrectable_ecc(node.nvml, lambda: topology)()[0]
    node.nvml.set_memory(sick, remap_pending=False, ecc_uncorrected_volatile=2)
    ok, detail = probes.no_uncorrectable_ecc(node.nvml, lambda: topology)()
    assert not ok and "2 uncorrectable" in detail


def test_a_lost_gpu_or_missing_nvml_fails_rather_than_passes(node):
    topology = node.topology()
    node.nvml.lose_gpu(topology.gpus[0].uuid)
    ok, detail = probes.no_pending_row_remap(node.nvml, lambda: topology)()
    assert not ok and "lost" in detail
    without = SimulatedNvml(node.profile.gpu_uuids, available=False)
    ok, detail = probes.no_uncorrectable_ecc(without, lambda: topology)()
    assert not ok and "NVML unavailable" in detail


def test_a_link_down_fails_the_link_probe(node):
    topology = node.topology()
    nic = topology.rdma_nics[1]
    state = node.sysfs_root / "bus/pci/devices" / nic.bus_id / "infiniband" / nic.rdma / "ports/1/state"
    state.write_text("1: DOWN\n")
    ok, detail = probes.nic_links_up(SysfsLinkPort(node.sysfs_root), lambda: topology)()
    assert not ok and f"{nic.rdma} port 1 is DOWN" in detail
