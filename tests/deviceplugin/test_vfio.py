"""DPDK pools (issue 29): VFs bound to vfio-pci are served as the SR-IOV device plugin serves them.

SR-IOV DP's vfio info provider (pkg/infoprovider/vfioInfoProvider.go, utils.GetVFIODeviceFile) gives a vfio-pci
function two device nodes, `/dev/vfio/vfio` and `/dev/vfio/<IOMMU group>` (the group from the function's
`iommu_group` link; `noiommu-<n>` on the host for vfio's no-IOMMU mode), and a `vfio` block in `_INFO`
(`mount`, `dev-mount`). Checked through the stand-in kubelet on the simulated `pcie-pairs-dpdk` node, whose second
socket's VFs are bound to vfio-pci, with the SR-IOV plugin's own DPDK example configs (data/sriovdp/SOURCES.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import yaml

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.pools import build_pools
from agent.deviceplugin.sriovdp import apply
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import SimulatedNode, build_simulated_node
from agent.topology.model import Topology
from tests.deviceplugin.conftest import dp_config

DATA = Path(__file__).parent / "data" / "sriovdp"
CX5_VFIO = {"resourceName": "cx5_dpdk", "selectors": [{"vendors": ["15b3"], "devices": ["1018"],
                                                         "drivers": ["vfio-pci"]}]}


@pytest.fixture(scope="module")
def dpdk_node() -> Iterator[SimulatedNode]:
    directory = Path(tempfile.mkdtemp(prefix="gnadpdk"))
    yield build_simulated_node("pcie-pairs-dpdk", directory / "sys")
    shutil.rmtree(directory, ignore_errors=True)


def _file(tmp_path: Path, resources: list[dict[str, object]]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"resourceList": resources}))
    return str(path)


def _served(config: DevicePluginConfig, topology: Topology) -> dict[str, tuple[str, ...]]:
    return {name: pool.ids for name, pool in build_pools(topology, config).by_name().items() if pool.kind == "nic"}


def test_the_reader_sees_iommu_groups_and_vfio_bound_vfs(dpdk_node: SimulatedNode) -> None:
    topology = dpdk_node.topology()
    vfio = [vf for nic in topology.rdma_nics for vf in nic.vfs if vf.pci.driver == "vfio-pci"]
    assert len(vfio) == 8 and all(vf.pci.iommu_group.isdigit() and vf.rdma is None for vf in vfio)
    groups = [f.pci.iommu_group for nic in topology.nics for f in (nic, *nic.vfs)]
    assert len(set(groups)) == len(groups)  # one group per function


def test_the_upstream_dpdk_configs_load_and_the_vfio_pool_takes_the_vfio_vfs(dpdk_node: SimulatedNode,
                                                                             tmp_path: Path) -> None:
    topology = dpdk_node.topology()
    for name in ("docs-dpdk-configMap.yaml", "docs-dpdk-configMap-all-nics.yaml"):
        path = tmp_path / name
        path.write_text(yaml.safe_load((DATA / name).read_text())["data"]["config.json"])
        served = _served(apply(DevicePluginConfig(sriov_dp_config=str(path))), topology)
        assert served  # loads, no refusal; an Intel X710 pool matches nothing on this node
    served = _served(apply(DevicePluginConfig(sriov_dp_config=_file(tmp_path, [CX5_VFIO]))), topology)
    assert len(served["intel.com/cx5_dpdk"]) == 8


async def test_a_vfio_vf_gets_both_vfio_device_nodes_and_the_info_block(
        dpdk_node: SimulatedNode, tmp_path: Path, sockdir: str, kubelet: LocalKubelet,
        make_manager: Callable[..., Awaitable[DevicePluginManager]]) -> None:
    topology = dpdk_node.topology()
    await make_manager(dp_config(sockdir, serve_gpus=False, sriov_dp_config=_file(tmp_path, [CX5_VFIO])), topology)
    resource = "intel.com/cx5_dpdk"
    await kubelet.wait_for(lambda: resource in kubelet.plugins and kubelet.plugins[resource].lists > 0)
    (vf_id,) = (await kubelet.admit({resource: 1}))[resource]
    reply = kubelet.responses[resource]
    group = next(vf.pci.iommu_group for nic in topology.nics for vf in nic.vfs if vf.bus_id == vf_id)
    assert sorted((d.host_path, d.container_path, d.permissions) for d in reply.devices) == [
        (f"/dev/vfio/{group}", f"/dev/vfio/{group}", "rw"), ("/dev/vfio/vfio", "/dev/vfio/vfio", "rw")]
    assert reply.envs["PCIDEVICE_INTEL_COM_CX5_DPDK"] == vf_id
    info = json.loads(reply.envs["PCIDEVICE_INTEL_COM_CX5_DPDK_INFO"])
    assert info == {vf_id: {"generic": {"deviceID": vf_id},
                            "vfio": {"mount": "/dev/vfio/vfio", "dev-mount": f"/dev/vfio/{group}"}}}


def _copy(node: SimulatedNode, tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(node.sysfs_root, root, symlinks=True)
    return root


def test_no_iommu_mode_and_a_vf_without_a_group(dpdk_node: SimulatedNode, tmp_path: Path) -> None:
    from agent.deviceplugin.payload import userspace_nodes  # the host path is what differs in no-IOMMU mode
    from agent.topology.load import load_topology

    root = _copy(dpdk_node, tmp_path)
    uuids = dpdk_node.nvml.gpu_uuids()
    vfs = [vf for nic in load_topology(root, uuids).nics for vf in nic.vfs if vf.pci.driver == "vfio-pci"]
    first, second = vfs[0], vfs[1]
    group_dir = (root / "bus/pci/devices" / first.bus_id / "iommu_group").resolve()
    (group_dir / "name").write_text("vfio-noiommu\n")
    os.unlink(root / "bus/pci/devices" / second.bus_id / "iommu_group")  # no IOMMU group: cannot be opened
    (root / "bus/pci/devices" / vfs[2].bus_id / "iommu_group").unlink()
    os.symlink("../../../../kernel/iommu_groups/../../etc", root / "bus/pci/devices" / vfs[2].bus_id / "iommu_group")
    topology = load_topology(root, uuids)
    config = DevicePluginConfig(sriov_dp_config=_file(tmp_path, [CX5_VFIO]))
    pools = build_pools(topology, apply(config))
    pool = pools.by_name()["intel.com/cx5_dpdk"]
    assert second.bus_id not in pool.ids and vfs[2].bus_id not in pool.ids  # not ready, counted
    assert any(second.bus_id in why and "no IOMMU group" in why for why in pools.skipped)
    assert pools.not_served["not_ready"] >= 2
    device = pool.device(first.bus_id)
    assert device is not None
    found = userspace_nodes(device)
    assert found is not None and found[2][1] == (f"/dev/vfio/noiommu-{first.pci.iommu_group}",
                                                 f"/dev/vfio/{first.pci.iommu_group}")


def test_config_shows_which_devices_each_pool_takes_on_this_node(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: `config --pools` with the SR-IOV file shows each pool's devices on the node before any rollout."""
    from agent import cli

    path = _file(tmp_path, [CX5_VFIO, {"resourceName": "cx5_rdma", "selectors": {"isRdma": True}}])
    assert cli.main(["config", "--pools", "--simulate", "pcie-pairs-dpdk", "--sriov-dp-config", path]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert len(shown["pools"]["intel.com/cx5_dpdk"]) == 8 and len(shown["pools"]["intel.com/cx5_rdma"]) == 8
    assert not set(shown["pools"]["intel.com/cx5_dpdk"]) & set(shown["pools"]["intel.com/cx5_rdma"])
