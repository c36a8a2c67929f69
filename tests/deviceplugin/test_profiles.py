"""ListAndWatch contents and Allocate payloads on the built-in simulated profiles (sysfs tree read back)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.deviceplugin.pools import PoolDevice, build_pools
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Topology
from tests.deviceplugin.conftest import dp_config

RDMA = "gpunodeagent.io/sriov_rdma"
GPU = "nvidia.com/gpu"
# profile -> (GPUs, RDMA PFs, VFs per PF, PF link type)
PROFILES = {"dgx-h100": (8, 8, 8, "infiniband"), "pcie-pairs": (8, 4, 4, "ether")}


@pytest.fixture(scope="module", params=sorted(PROFILES))
def profile(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Topology]:
    name = request.param
    return name, simulated_topology(name, Path(tmp_path_factory.mktemp(name)))


def test_profile_pools(profile: tuple[str, Topology]) -> None:
    name, topology = profile
    gpus, pfs, vfs_per_pf, link = PROFILES[name]
    pools = build_pools(topology, dp_config("/unused")).by_name()
    rdma = pools[RDMA]
    assert len(rdma.devices) == pfs * vfs_per_pf
    rdma_pfs = [nic for nic in topology.nics if nic.is_rdma]
    assert len(rdma_pfs) == pfs and {nic.link_type for nic in rdma_pfs} == {link}
    assert set(rdma.ids) == {vf.bus_id for nic in rdma_pfs for vf in nic.vfs}
    non_rdma = {nic.bus_id for nic in topology.nics if not nic.is_rdma}
    assert non_rdma.isdisjoint(rdma.ids)  # Ethernet NICs without RDMA are not sriov_rdma devices
    assert pools[GPU].ids == tuple(gpu.uuid for gpu in topology.gpus) and len(pools[GPU].ids) == gpus


async def test_profile_list_and_watch(profile: tuple[str, Topology], sockdir: str, make_manager) -> None:
    _, topology = profile
    kubelet = LocalKubelet(sockdir)
    await kubelet.start()
    try:
        manager = await make_manager(dp_config(sockdir), topology)
        pools = build_pools(topology, manager.config).by_name()
        await kubelet.wait_for(lambda: all(
            r in kubelet.plugins and len(kubelet.plugins[r].devices) == len(pools[r].devices) for r in (RDMA, GPU)),
            10)
        for resource in (RDMA, GPU):
            listed = kubelet.plugins[resource].devices
            expected: dict[str, PoolDevice] = {d.id: d for d in pools[resource].devices}
            assert set(listed) == set(expected)
            for device_id, device in listed.items():
                assert device.health == "Healthy"
                assert [n.ID for n in device.topology.nodes] == [expected[device_id].numa]
        chosen = await kubelet.admit({RDMA: 2, GPU: 1})
        response = kubelet.responses[RDMA]
        by_id = {d.id: d for d in pools[RDMA].devices}
        hcas = sorted(f"{by_id[i].rdma}:1" for i in chosen[RDMA])
        assert sorted(response.envs["NCCL_IB_HCA"].lstrip("=").split(",")) == hcas
        paths = {d.host_path for d in response.devices}
        assert paths == {"/dev/infiniband/rdma_cm"} | {
            f"/dev/infiniband/{by_id[i].function.chardevs.uverbs}" for i in chosen[RDMA]}
        assert kubelet.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"] == chosen[GPU][0]
        await asyncio.wait_for(manager.registered.wait(), 10)
    finally:
        await kubelet.stop()
