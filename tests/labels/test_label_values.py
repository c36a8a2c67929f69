"""The label values, as pure functions of the facts the simulated profiles report (GFD v0.20.0's rules)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent.config.sharing import ReplicatedResourceConfig, TimeSlicingConfig
from agent.host import pci_config
from agent.host.nic_sysfs import NicSysfs
from agent.labels import own
from agent.labels.gfd import GfdError, GfdInputs, family, gfd_labels, sanitise
from agent.simulate.node import build_simulated_node
from tests.labels.rig import H100_GFD, H100_OWN, MIG_1G_10GB


def _node(profile: str, tmp_path: Path):
    return build_simulated_node(profile, tmp_path / "sys")


def _inputs(node, **changes) -> GfdInputs:
    topology = node.topology()
    root = node.sysfs_root
    return GfdInputs(machine_type=pci_config.read_machine_type(root),
                     gpu_classes=tuple(g.pci.pci_class for g in topology.gpus), vgpu=pci_config.scan_vgpu(root),
                     **changes)


def _own(node) -> dict[str, str]:
    topology = node.topology()
    labels = own.topology_labels(topology)
    nic = NicSysfs(node.sysfs_root)
    ports = [nic.read_port(n.rdma or "", p)[0] for n in topology.rdma_nics for p in nic.ports(n.rdma or "")]
    labels.update(own.rate_label([p for p in ports if p is not None]) or {})
    return labels


def test_dgx_h100_gets_gfds_values_for_eight_h100s(tmp_path):
    node = _node("dgx-h100", tmp_path)
    assert gfd_labels(node.nvml.facts(), _inputs(node)) == H100_GFD
    assert _own(node) == {k: v for k, v in H100_OWN.items() if "gpu.expected" not in k and "gpu.healthy" not in k}


def test_mixed_mig_adds_the_profile_and_counts_every_gpu(tmp_path):
    node = _node("dgx-h100-mig", tmp_path)
    assert gfd_labels(node.nvml.facts(), _inputs(node, mig_strategy="mixed")) == {**H100_GFD, **MIG_1G_10GB}


def test_single_on_a_half_mig_node_is_gfds_invalid_set(tmp_path):
    node = _node("dgx-h100-mig", tmp_path)
    labels = gfd_labels(node.nvml.facts(), _inputs(node, mig_strategy="single"))
    assert {k: labels[k] for k in labels if k.startswith("nvidia.com/gpu.") and k.split(".")[-1] in (
        "product", "count", "replicas", "sharing-strategy", "memory")} == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-INVALID", "nvidia.com/gpu.count": "0",
        "nvidia.com/gpu.replicas": "0", "nvidia.com/gpu.sharing-strategy": "", "nvidia.com/gpu.memory": "0"}
    assert labels["nvidia.com/mig.strategy"] == "single" and labels["nvidia.com/gpu.family"] == "hopper"


def test_single_on_an_all_mig_node_describes_the_mig_devices(tmp_path):
    node = _node("dgx-h100-mig", tmp_path)
    facts = node.nvml.facts()
    donor = facts.gpus[0]
    everything = tuple(dataclasses.replace(g, mig_enabled=True, mig_devices=donor.mig_devices) for g in facts.gpus)
    facts = dataclasses.replace(facts, gpus=everything)
    labels = gfd_labels(facts, _inputs(node, mig_strategy="single"))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"
    assert labels["nvidia.com/gpu.count"] == "56"
    assert labels["nvidia.com/gpu.memory"] == "9984" and labels["nvidia.com/gpu.multiprocessors"] == "16"
    assert labels["nvidia.com/gpu.replicas"] == "1" and labels["nvidia.com/gpu.sharing-strategy"] == "none"


@pytest.mark.parametrize(("rename", "product"), [(False, "NVIDIA-H100-80GB-HBM3-SHARED"),
                                                 (True, "NVIDIA-H100-80GB-HBM3")])
def test_time_slicing_replicas_ten(tmp_path, rename, product):
    node = _node("dgx-h100", tmp_path)
    sharing = TimeSlicingConfig([ReplicatedResourceConfig("nvidia.com/gpu", 10)], rename_by_default=rename)
    labels = gfd_labels(node.nvml.facts(), _inputs(node, time_slicing=sharing))
    assert labels == {**H100_GFD, "nvidia.com/gpu.product": product, "nvidia.com/gpu.replicas": "10",
                      "nvidia.com/gpu.sharing-strategy": "time-slicing"}


def test_pcie_pairs_v100_and_roce(tmp_path):
    node = _node("pcie-pairs", tmp_path)
    labels = gfd_labels(node.nvml.facts(), _inputs(node))
    assert {k: labels[k] for k in ("nvidia.com/gpu.product", "nvidia.com/gpu.family", "nvidia.com/gpu.memory",
                                   "nvidia.com/gpu.compute.major", "nvidia.com/mig.capable")} == {
        "nvidia.com/gpu.product": "Tesla-V100-SXM2-16GB", "nvidia.com/gpu.family": "volta",
        "nvidia.com/gpu.memory": "16160", "nvidia.com/gpu.compute.major": "7", "nvidia.com/mig.capable": "false"}
    assert _own(node) == {"gpunodeagent.io/gpu-nic.pix": "8", "gpunodeagent.io/nic.rdma.count": "4",
                          "gpunodeagent.io/nic.rate-gbps": "100", "gpunodeagent.io/nic.link-layer": "ethernet",
                          "gpunodeagent.io/topology.source": "sysfs"}


def test_vm_flat_topology_from_nccl_xml(tmp_path):
    assert _own(_node("vm-flat", tmp_path))["gpunodeagent.io/topology.source"] == "nccl-xml"


def test_gfds_small_rules():
    assert sanitise("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert sanitise("  NVIDIA  DGX-2H (rev) \n") == "NVIDIA-DGX-2H-rev"
    assert [family(*cc) for cc in ((7, 0), (7, 5), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (13, 0), (4, 0))] == [
        "volta", "turing", "ampere", "ada-lovelace", "hopper", "blackwell", "blackwell", "rubin", "undefined"]


def test_a_driver_version_gfd_refuses_fails_the_reading(tmp_path):
    node = _node("dgx-h100", tmp_path)
    with pytest.raises(GfdError):
        gfd_labels(dataclasses.replace(node.nvml.facts(), driver_version="550"), _inputs(node))


def test_the_vgpu_scan_reads_the_vendor_capability(tmp_path):
    node = _node("dgx-h100", tmp_path)
    assert pci_config.scan_vgpu(node.sysfs_root) == pci_config.VgpuCapability(False)
    bus_id = sorted(node.profile.gpu_uuids)[0]
    config_path = node.sysfs_root / "bus/pci/devices" / bus_id / "config"
    space = bytearray(config_path.read_bytes())
    record = bytes((0x00, 22)) + b"550.54.14\0" + b"r550_00\0\0\0"
    capability = bytes((0x09, 0x00, 5 + len(record))) + b"VF" + record
    space[0x61] = 0x80  # the PM capability now points at a vendor-specific one
    space[0x80:0x80 + len(capability)] = capability
    config_path.write_bytes(bytes(space))
    assert pci_config.scan_vgpu(node.sysfs_root) == pci_config.VgpuCapability(True, "550.54.14", "r550_00")
    config_path.write_bytes(bytes(space[:64]))  # what a non-root reader gets
    with pytest.raises(pci_config.PciScanError):
        pci_config.scan_vgpu(node.sysfs_root)


def test_healthy_gpus_keep_their_last_known_state_while_unknown(tmp_path):
    gpus = _node("dgx-h100", tmp_path).topology().gpus
    uuids = [g.uuid for g in gpus]
    healthy = own.HealthyGpus()
    assert healthy.count(gpus, set(), set()) == 8
    assert healthy.count(gpus, {uuids[0]}, set()) == 7
    assert healthy.count(gpus, set(uuids), set(uuids)) == 7  # NVML down: every GPU unknown, counts as it was
    fresh = own.HealthyGpus()
    assert fresh.count(gpus, set(uuids), set(uuids)) is None  # never known: no value at all


def test_a_machine_type_past_63_characters_is_left_out_not_published_invalid(tmp_path):
    from agent.labels.service import valid

    node = _node("dgx-h100", tmp_path)
    (node.sysfs_root / "class/dmi/id").mkdir(parents=True)
    (node.sysfs_root / "class/dmi/id/product_name").write_text("DGX H100 " + "x" * 80 + "\n")
    labels = gfd_labels(node.nvml.facts(), _inputs(node))
    assert not valid("nvidia.com/gpu.machine", labels["nvidia.com/gpu.machine"])
    assert all(valid(k, v) for k, v in labels.items() if k != "nvidia.com/gpu.machine")
    assert valid("nvidia.com/cuda.driver.rev", "") and not valid("x/y", "-a") and not valid("x/" + "n" * 64, "1")
