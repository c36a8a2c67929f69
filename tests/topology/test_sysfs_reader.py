"""The sysfs reader on every simulated profile, and on broken trees (it skips and warns, never raises)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest

from agent import cli
from agent.host.nvml import SimulatedNvml
from agent.simulate import profiles
from agent.simulate.node import build_simulated_node
from agent.simulate.sysfs_writer import profile_tree
from agent.topology.load import load_topology
from agent.topology.model import Level
from agent.topology.sysfs import SysfsReader

# Per profile: how many GPUs, RDMA PFs, VFs, non-RDMA NICs, and the levels each GPU sees to the RDMA NICs.
EXPECTED = {
    "dgx-h100": dict(gpus=8, rdma=8, vfs=64, plain=2,
                     per_gpu={Level.PIX: 1, Level.PXB: 1, Level.NODE: 2, Level.SYS: 4}),
    # dgx-h100 with GPUs 0-3 in MIG mode (NVML's view): the same tree
    "dgx-h100-mig": dict(gpus=8, rdma=8, vfs=64, plain=2,
                         per_gpu={Level.PIX: 1, Level.PXB: 1, Level.NODE: 2, Level.SYS: 4}),
    "pcie-pairs": dict(gpus=8, rdma=4, vfs=16, plain=0,
                       per_gpu={Level.PIX: 1, Level.PHB: 1, Level.SYS: 2}),
    # the second socket's VFs bound to vfio-pci (DPDK): no RDMA device, no netdev, an IOMMU group
    "pcie-pairs-dpdk": dict(gpus=8, rdma=4, vfs=16, plain=0, vfio=8,
                            per_gpu={Level.PIX: 1, Level.PHB: 1, Level.SYS: 2}),
    # sysfs alone: every device on its own root complex, so a VM hides its switches
    "vm-flat": dict(gpus=8, rdma=8, vfs=0, plain=0, per_gpu={Level.NODE: 4, Level.SYS: 4}),
    # Data Direct: each GPU PXB to its NIC's DMA function, P2C to the other NIC of its Grace socket
    "gb300-cx8": dict(gpus=4, rdma=4, vfs=16, plain=0, per_gpu={Level.PXB: 1, Level.P2C: 1, Level.SYS: 2}),
    # C2C: P2C to the socket's two ConnectX-7, NODE to its BlueField-3
    "gb200-cx7": dict(gpus=4, rdma=6, vfs=16, plain=0, per_gpu={Level.P2C: 2, Level.NODE: 1, Level.SYS: 3}),
    # inline: PXB to the NIC whose switch the GPU hangs below, NODE to the socket's others
    "hgx-b300-cx8": dict(gpus=8, rdma=8, vfs=32, plain=0, per_gpu={Level.PXB: 1, Level.NODE: 3, Level.SYS: 4}),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    nodes = {}
    for name in profiles.list_profiles():
        nodes[name] = build_simulated_node(name, tmp_path_factory.mktemp(name))
    return nodes


def test_all_profiles_are_covered():
    assert set(profiles.list_profiles()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_profile_reads_back_with_every_level_it_is_built_for(written, name):
    node = written[name]
    topology = SysfsReader(node.sysfs_root).read(node.nvml.gpu_uuids())
    want = EXPECTED[name]
    assert len(topology.gpus) == want["gpus"]
    assert len(topology.rdma_nics) == want["rdma"]
    assert sum(len(n.vfs) for n in topology.rdma_nics) == want["vfs"]
    assert len([n for n in topology.nics if not n.is_rdma]) == want["plain"]
    assert [g.index for g in topology.gpus] == list(range(want["gpus"]))
    assert [g.bus_id for g in topology.gpus] == sorted(g.bus_id for g in topology.gpus)
    assert all(g.uuid and g.uuid.startswith("GPU-") for g in topology.gpus)
    for gpu in topology.gpus:
        seen = Counter(topology.level(gpu.bus_id, nic.bus_id) for nic in topology.rdma_nics)
        assert dict(seen) == want["per_gpu"], gpu.bus_id
    # VFs sit where their PF sits (its data path), and each has its own RDMA device and verbs node
    for nic in topology.rdma_nics:
        for vf in nic.vfs:
            assert topology.location(vf.bus_id) == topology.location(nic.bus_id)
            if vf.pci.driver == "vfio-pci":
                assert not vf.rdma and not vf.netdevs and vf.pci.iommu_group
            else:
                assert vf.rdma and vf.chardevs.uverbs and vf.netdevs
            assert vf.pf_bus_id == nic.bus_id
    vfio = [vf for nic in topology.rdma_nics for vf in nic.vfs if vf.pci.driver == "vfio-pci"]
    assert len(vfio) == want.get("vfio", 0)


def test_every_dgx_gpu_is_pix_to_exactly_one_nic_and_vice_versa(written):
    topology = written["dgx-h100"].topology()
    pairs = {(g.bus_id, n.bus_id) for g in topology.gpus for n in topology.rdma_nics
             if topology.level(g.bus_id, n.bus_id) is Level.PIX}
    assert len(pairs) == 8
    assert len({g for g, _ in pairs}) == len({n for _, n in pairs}) == 8


def test_dgx_details_match_the_kernel_layout(written):
    topology = written["dgx-h100"].topology()
    nic = topology.find("0000:18:00.0")
    assert nic.rdma == "mlx5_0" and nic.netdevs == ("ibp24s0",) and nic.link_type == "infiniband"
    assert nic.pci.driver == "mlx5_core" and nic.pci.vendor == "0x15b3" and nic.sriov_totalvfs >= 8
    assert [p.state for p in nic.ports] == ["ACTIVE"]
    vf = nic.vfs[0]
    assert vf.bus_id == "0000:18:00.1" and vf.vf_index == 0 and vf.link_type == "infiniband"
    gpu = topology.gpus[0]
    assert gpu.pci.driver == "nvidia" and gpu.pci.pci_class == "0x030200" and gpu.numa == 0
    assert gpu.location.root == "pci0000:10" and len(gpu.location.switches) == 2


def test_pcie_pairs_nics_are_roce(written):
    topology = written["pcie-pairs"].topology()
    assert {n.link_type for n in topology.rdma_nics} == {"ether"}
    assert all(len(n.vfs) == 4 for n in topology.rdma_nics)


def test_vm_flat_xml_reveals_the_pairs(written):
    topology = written["vm-flat"].topology()
    assert topology.source == "sysfs+nccl-xml"
    for gpu in topology.gpus:
        seen = Counter(topology.level(gpu.bus_id, nic.bus_id) for nic in topology.rdma_nics)
        assert dict(seen) == {Level.PIX: 1, Level.PHB: 3, Level.SYS: 4}
    # the XML only moves devices; sysfs still names them
    assert [n.rdma for n in topology.rdma_nics] == [f"mlx5_{i}" for i in range(8)]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_levels_are_symmetric_on_every_profile(written, name):
    topology = written[name].topology()
    devices = [g.bus_id for g in topology.gpus] + [n.bus_id for n in topology.nics]
    for a in devices:
        for b in devices:
            assert topology.level(a, b) == topology.level(b, a)
            assert (topology.level(a, b) is Level.X) == (a == b)


def test_topology_json_schema(capsys):
    assert cli.main(["topology", "--simulate", "dgx-h100", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"gpus", "nics", "links"}
    assert doc["gpus"][0] == {**doc["gpus"][0], "index": 0, "pci": "0000:1b:00.0", "numa": 0}
    assert doc["gpus"][0]["uuid"].startswith("GPU-")
    assert doc["nics"][0]["rdma"] == "mlx5_0" and doc["nics"][0]["netdev"] == "ibp24s0"
    assert len(doc["nics"][0]["vfs"]) == 8 and len(doc["nics"]) == 8  # RDMA PFs only
    assert doc["links"]["0000:1b:00.0"]["0000:18:00.0"] == "PIX"
    assert all(len(row) == 8 for row in doc["links"].values())


def test_topology_matrix_has_a_legend(capsys):
    assert cli.main(["topology", "--simulate", "pcie-pairs"]) == 0
    out = capsys.readouterr().out
    assert "GPU0" in out and "NIC3" in out and "Legend:" in out and "PIX  =" in out


def test_topology_reads_a_written_tree_and_an_xml_file(tmp_path, capsys):
    node = build_simulated_node("vm-flat", tmp_path / "sys")
    assert cli.main(["topology", "--sysfs-root", str(node.sysfs_root), "--json"]) == 0
    flat = json.loads(capsys.readouterr().out)
    assert flat["links"]["0001:00:00.0"]["0101:00:00.0"] == "NODE"
    assert cli.main(["topology", "--sysfs-root", str(node.sysfs_root), "--json",
                     "--topology-file", str(node.topology_file)]) == 0
    paired = json.loads(capsys.readouterr().out)
    assert paired["links"]["0001:00:00.0"]["0101:00:00.0"] == "PIX"


@pytest.mark.parametrize("xml", ["<system><cpu numaid='0'><pci busid='zz'/></cpu></system>", "<system", ""])
def test_malformed_xml_exits_2(tmp_path, capsys, xml):
    bad = tmp_path / "bad.xml"
    bad.write_text(xml)
    node = build_simulated_node("vm-flat", tmp_path / "sys")
    assert cli.main(["topology", "--sysfs-root", str(node.sysfs_root), "--topology-file", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


def test_unknown_profile_exits_2_and_lists_the_known_ones(capsys):
    assert cli.main(["topology", "--simulate", "dgx-a100"]) == 2
    assert "dgx-h100" in capsys.readouterr().err


# --- broken trees: each case damages the dgx-h100 tree; the damaged device is skipped with one warning
# naming the path, and everything else is still read.

GPU0 = "0000:1b:00.0"


def _gpu_dir(tree) -> str:
    target = tree.get(f"bus/pci/devices/{GPU0}")
    return str(Path(f"bus/pci/devices/{GPU0}").parent / target.target).replace("bus/pci/devices/../../../", "")


def _break_dangling(tree):
    tree.remove(f"bus/pci/devices/{GPU0}")
    tree.add_symlink(f"bus/pci/devices/{GPU0}", "../../../devices/pci0000:10/missing/0000:1b:00.0")


def _break_missing_class(tree):
    tree.remove(f"{_gpu_dir(tree)}/class")


def _break_garbage_class(tree):
    tree.remove(f"{_gpu_dir(tree)}/class")
    tree.add_file(f"{_gpu_dir(tree)}/class", "\x00\xffgarbage\n")


def _break_unreadable_class(tree):
    # root can read any file whatever its mode, so make the file unreadable the way sysfs can: a directory
    tree.remove(f"{_gpu_dir(tree)}/class")
    tree.add_dir(f"{_gpu_dir(tree)}/class")


def _break_outside(tree):
    tree.remove(f"bus/pci/devices/{GPU0}")
    tree.add_dir(f"elsewhere/{GPU0}")
    tree.add_symlink(f"bus/pci/devices/{GPU0}", f"../../../elsewhere/{GPU0}")


def _break_not_a_bus_id(tree):
    tree.add_symlink("bus/pci/devices/garbage", "../../../devices/pci0000:10")


@pytest.mark.parametrize(("damage", "gone", "named"), [
    (_break_dangling, GPU0, f"bus/pci/devices/{GPU0}"),
    (_break_missing_class, GPU0, "class"),
    (_break_garbage_class, GPU0, "not a hex number"),
    (_break_unreadable_class, GPU0, "cannot read"),
    (_break_outside, GPU0, "resolves outside"),
    (_break_not_a_bus_id, None, "bus/pci/devices/garbage"),
])
def test_broken_device_is_skipped_with_one_warning(tmp_path, caplog, damage, gone, named):
    profile = profiles.load_profile("dgx-h100")
    tree = profile_tree(profile)
    damage(tree)
    tree.write(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agent.topology.sysfs"):
        topology = SysfsReader(tmp_path).read(profile.gpu_uuids)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert named in warnings[0]
    bus_ids = [g.bus_id for g in topology.gpus]
    assert len(bus_ids) == (7 if gone else 8)
    assert gone not in bus_ids
    assert len(topology.rdma_nics) == 8  # the rest of the node is intact


def test_garbage_numa_node_reads_as_unknown(tmp_path, caplog):
    profile = profiles.load_profile("dgx-h100")
    tree = profile_tree(profile)
    tree.remove(f"{_gpu_dir(tree)}/numa_node")
    tree.add_file(f"{_gpu_dir(tree)}/numa_node", "banana\n")
    tree.write(tmp_path)
    with caplog.at_level(logging.WARNING):
        topology = SysfsReader(tmp_path).read()
    assert topology.gpus[0].numa is None
    assert "numa_node" in caplog.text


def test_vf_whose_pf_is_gone_is_skipped(tmp_path, caplog):
    profile = profiles.load_profile("dgx-h100")
    tree = profile_tree(profile)
    tree.remove("bus/pci/devices/0000:18:00.0")
    tree.write(tmp_path)
    with caplog.at_level(logging.WARNING):
        topology = SysfsReader(tmp_path).read()
    assert topology.find("0000:18:00.1") is None
    assert len(topology.rdma_nics) == 7
    assert "0000:18:00.1" in caplog.text


def test_empty_or_missing_root_gives_an_empty_model(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        topology = SysfsReader(tmp_path / "nothing").read()
    assert topology.gpus == () and topology.nics == ()
    assert "no PCI devices" in caplog.text


def test_uuids_come_from_nvml_in_any_bus_id_form(written):
    node = written["dgx-h100"]
    nvml_style = {k.upper().replace("0000:", "00000000:", 1): v for k, v in node.nvml.gpu_uuids().items()}
    topology = load_topology(node.sysfs_root, SimulatedNvml(nvml_style).gpu_uuids())
    assert [g.uuid for g in topology.gpus] == [node.profile.gpu_uuids[g.bus_id] for g in topology.gpus]


def test_a_fifo_for_a_vendor_file_is_skipped_without_blocking(tmp_path, caplog):
    """Issue 27 (risks): a FIFO planted as a sysfs `vendor` file blocked the topology scan in open() for ever."""
    import os
    import threading

    profile = profiles.load_profile("dgx-h100")
    tree = profile_tree(profile)
    tree.remove(f"{_gpu_dir(tree)}/vendor")
    tree.write(tmp_path)
    fifo = tmp_path / _gpu_dir(tree) / "vendor"
    os.mkfifo(fifo)
    found = []
    with caplog.at_level(logging.WARNING, logger="agent.topology.sysfs"):
        reader = threading.Thread(target=lambda: found.append(SysfsReader(tmp_path).read(profile.gpu_uuids)))
        reader.start()
        reader.join(10)
        if reader.is_alive():  # the old reader: release it (a writer that closes at once), then fail
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            reader.join(10)
            pytest.fail("reading the topology blocked on a FIFO")
    assert GPU0 not in [g.bus_id for g in found[0].gpus] and len(found[0].gpus) == 7
    assert "not a regular file" in caplog.text
