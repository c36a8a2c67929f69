"""Selectors to resource pools: first match wins, VFs vs VF-less PFs, the GPU pool, config errors."""

from __future__ import annotations

import logging

import pytest

from agent.config.model import DevicePluginConfig, PoolConfig, SelectorConfig
from agent.config.sharing import ReplicatedResourceConfig, TimeSlicingConfig
from agent.deviceplugin.pools import PoolConfigError, build_pools, share, socket_name
from agent.host.unixsocket import MAX_SOCKET_PATH
from tests.deviceplugin.conftest import GPU_UUIDS, small_topology


def _pools(**changes: object) -> dict[str, object]:
    config = DevicePluginConfig(**changes)  # type: ignore[arg-type]
    return build_pools(small_topology(), config).by_name()


def test_default_config_serves_rdma_vfs_only() -> None:
    pools = _pools()
    assert list(pools) == ["gpunodeagent.io/sriov_rdma"]
    pool = pools["gpunodeagent.io/sriov_rdma"]
    assert pool.kind == "nic"
    # VFs of both IB PFs, in bus-id order; PFs with VFs and the non-RDMA Ethernet PF are not devices
    assert pool.ids == ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4",
                        "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4")
    assert [d.numa for d in pool.devices] == [0, 0, 0, 1, 1, 1]
    assert pool.devices[0].rdma == "mlx5_1"
    assert pool.devices[0].pf is not None and pool.devices[0].pf.bus_id == "0000:1a:00.0"


def test_first_matching_pool_wins_and_vf_less_pf_can_be_selected() -> None:
    pools = _pools(pools=[
        PoolConfig(resource_name="ib_a", selectors=SelectorConfig(pf_names=["ibp26s0"])),
        PoolConfig(resource_name="all_rdma", selectors=SelectorConfig(is_rdma=True)),
        PoolConfig(resource_name="eth", resource_prefix="example.com",
                   selectors=SelectorConfig(link_types=["ether"], is_rdma=False)),
    ])
    assert pools["gpunodeagent.io/ib_a"].ids == ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4")
    assert pools["gpunodeagent.io/all_rdma"].ids == ("0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4")
    eth = pools["example.com/eth"]
    assert eth.ids == ("0000:c1:00.0",)  # a PF without VFs is a device when selected
    assert eth.devices[0].rdma is None


@pytest.mark.parametrize(("selector", "expected"), [
    (SelectorConfig(vendors=["15b3"], devices=["0x101e"]), 6),
    (SelectorConfig(vendors=["8086"]), 1),
    (SelectorConfig(drivers=["ice"]), 1),
    (SelectorConfig(devices=["101d"]), 0),  # the PF's device id: PFs with VFs are never candidates
    (SelectorConfig(pf_names=["ibp154s0#0,2"]), 2),
    (SelectorConfig(root_devices=["0000:1a:00.0#1-2"]), 2),
    (SelectorConfig(pci_addresses=["0000:9a:00.3", "0000:c1:00.0"]), 2),
    (SelectorConfig(link_types=["InfiniBand"]), 6),
    (SelectorConfig(is_rdma=False), 1),
])
def test_selectors(selector: SelectorConfig, expected: int) -> None:
    pools = _pools(pools=[PoolConfig(resource_name="p", selectors=selector)])
    assert len(pools["gpunodeagent.io/p"].devices) == expected


def test_pf_without_vfs_is_candidate_when_sriov_numvfs_is_zero() -> None:
    topology = small_topology(vfs_per_pf=0)
    pool = build_pools(topology, DevicePluginConfig()).by_name()["gpunodeagent.io/sriov_rdma"]
    assert pool.ids == ("0000:1a:00.0", "0000:9a:00.0")
    assert pool.devices[0].rdma == "mlx5_0"


def test_gpu_pool_uses_uuids_and_skips_gpus_without_one() -> None:
    scan = build_pools(small_topology(gpu_without_uuid=True), DevicePluginConfig(serve_gpus=True))
    gpus = scan.by_name()["nvidia.com/gpu"]
    assert gpus.kind == "gpu"
    assert gpus.ids == GPU_UUIDS[:3]
    assert [d.numa for d in gpus.devices] == [0, 0, 1]
    assert scan.skipped == ("GPU 3 at 0000:48:00.0 has no UUID",)


def test_gpu_pool_off_by_default() -> None:
    assert "nvidia.com/gpu" not in _pools()


async def test_manager_warns_once_about_gpus_without_uuid(caplog: pytest.LogCaptureFixture) -> None:
    from agent.deviceplugin.manager import DevicePluginManager

    manager = DevicePluginManager(DevicePluginConfig(serve_gpus=True), small_topology(gpu_without_uuid=True))
    with caplog.at_level(logging.WARNING):
        await manager._scan(small_topology(gpu_without_uuid=True))
        await manager._scan(small_topology(gpu_without_uuid=True))
    assert sum("has no UUID" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(("changes", "message"), [
    ({"pools": [PoolConfig(resource_name="bad name")]}, "must match"),
    ({"pools": [PoolConfig(resource_name="x", resource_prefix="kubernetes.io")]}, "kubernetes.io"),
    ({"pools": [PoolConfig(resource_name="x", resource_prefix="Not_A_Domain")]}, "DNS subdomain"),
    ({"pools": [PoolConfig(resource_name="x"), PoolConfig(resource_name="x")]}, "configured twice"),
    ({"serve_gpus": True, "gpu_resource_name": "gpu"}, "needs a prefix"),
])
def test_bad_pool_config(changes: dict[str, object], message: str) -> None:
    with pytest.raises(PoolConfigError, match=message):
        build_pools(small_topology(), DevicePluginConfig(**changes))  # type: ignore[arg-type]


def test_socket_names_are_short_and_distinct() -> None:
    long_name = "example.com/" + "r" * 63
    assert len(socket_name(long_name)) <= 40
    assert socket_name("a.com/x") != socket_name("b.com/x")
    assert socket_name("nvidia.com/gpu").startswith("gna-gpu-")
    # the default directory leaves plenty of room under the AF_UNIX limit
    assert len(f"/var/lib/kubelet/device-plugins/{socket_name(long_name)}") < MAX_SOCKET_PATH


def test_exclude_topology_and_unknown_numa() -> None:
    config = DevicePluginConfig(pools=[PoolConfig(resource_name="r", exclude_topology=True,
                                                  selectors=SelectorConfig(is_rdma=True))])
    pool = build_pools(small_topology(), config).by_name()["gpunodeagent.io/r"]
    assert pool.exclude_topology
    unknown = build_pools(small_topology(numa_unknown=True), DevicePluginConfig()).pools[0]
    assert {d.numa for d in unknown.devices} == {None}


def test_replica_pool_maps_physical_ids_to_its_replicas() -> None:
    [gpus] = [p for p in build_pools(small_topology(), DevicePluginConfig(serve_gpus=True)).pools if p.kind == "gpu"]
    sharing = TimeSlicingConfig(resources=[ReplicatedResourceConfig(name=gpus.resource_name, replicas=3)])
    [pool] = share([gpus], sharing)
    assert pool.serves_physical(GPU_UUIDS[1]) and not pool.serves_physical(f"{GPU_UUIDS[1]}::0")
    assert pool.ids_of([GPU_UUIDS[1], "GPU-not-here"]) == {f"{GPU_UUIDS[1]}::{n}" for n in range(3)}
    assert pool.device(f"{GPU_UUIDS[2]}::2") == pool.devices[8]
    assert gpus.ids_of([GPU_UUIDS[0]]) == {GPU_UUIDS[0]} and gpus.device("nope") is None
