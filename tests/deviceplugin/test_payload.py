"""Allocate payloads built from the contributors (no gRPC here; test_server covers the wire)."""

from __future__ import annotations

import json

from agent.config.model import DevicePluginConfig, PoolConfig, SelectorConfig
from agent.deviceplugin.payload import AllocateOptions, build_container_payload, pcidevice_env_key
from agent.deviceplugin.pools import ResourcePool, build_pools
from tests.deviceplugin.conftest import GPU_UUIDS, small_topology

RESOURCE = "gpunodeagent.io/sriov_rdma"
KEY = "PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA"


def _pool(name: str = RESOURCE, **changes: object) -> ResourcePool:
    config = DevicePluginConfig(serve_gpus=True, **changes)  # type: ignore[arg-type]
    return build_pools(small_topology(), config).by_name()[name]


def _devices(pool: ResourcePool, *ids: str) -> list:
    return [pool.device(i) for i in ids]


def test_env_key_form_matches_sriov_dp() -> None:
    assert pcidevice_env_key("intel.com/intel_sriov_netdevice") == "PCIDEVICE_INTEL_COM_INTEL_SRIOV_NETDEVICE"
    assert pcidevice_env_key(RESOURCE) == KEY


def test_rdma_vf_payload() -> None:
    pool = _pool()
    payload = build_container_payload(pool, _devices(pool, "0000:9a:00.3", "0000:1a:00.2"), AllocateOptions())
    proto = payload.to_proto()
    specs = [(d.host_path, d.container_path, d.permissions) for d in proto.devices]
    assert specs == [
        ("/dev/infiniband/uverbs12", "/dev/infiniband/uverbs12", "rw"),
        ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm", "rw"),  # once, though both VFs need it
        ("/dev/infiniband/uverbs1", "/dev/infiniband/uverbs1", "rw"),
    ]
    assert not any("umad" in s[0] or "issm" in s[0] for s in specs)
    envs = dict(proto.envs)
    assert set(envs) == {KEY, f"{KEY}_INFO", "NCCL_IB_HCA"}
    assert envs[KEY] == "0000:9a:00.3,0000:1a:00.2"
    assert envs["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_12:1"  # exact-match syntax, only the allocated HCAs
    assert json.loads(envs[f"{KEY}_INFO"]) == {
        "0000:9a:00.3": {"generic": {"deviceID": "0000:9a:00.3"},
                         "rdma": {"uverbs": "/dev/infiniband/uverbs12", "rdma_cm": "/dev/infiniband/rdma_cm",
                                  "rdma_dev": "mlx5_12"}},
        "0000:1a:00.2": {"generic": {"deviceID": "0000:1a:00.2"},
                         "rdma": {"uverbs": "/dev/infiniband/uverbs1", "rdma_cm": "/dev/infiniband/rdma_cm",
                                  "rdma_dev": "mlx5_1"}},
    }
    assert not proto.mounts and not proto.cdi_devices


def test_mad_devices_behind_switch() -> None:
    pool = _pool()
    options = AllocateOptions.from_config(DevicePluginConfig(rdma_mad_devices=True))
    proto = build_container_payload(pool, _devices(pool, "0000:1a:00.3"), options).to_proto()
    assert [d.host_path for d in proto.devices] == [
        "/dev/infiniband/uverbs2", "/dev/infiniband/umad2", "/dev/infiniband/issm2",
        "/dev/infiniband/rdma_cm"]
    info = json.loads(proto.envs[f"{KEY}_INFO"])["0000:1a:00.3"]["rdma"]
    assert info["umad"] == "/dev/infiniband/umad2" and info["issm"] == "/dev/infiniband/issm2"


def test_non_rdma_pf_payload_has_no_rdma_parts() -> None:
    pool = _pool("example.com/eth", pools=[
        PoolConfig(resource_name="eth", resource_prefix="example.com",
                   selectors=SelectorConfig(is_rdma=False))])
    proto = build_container_payload(pool, _devices(pool, "0000:c1:00.0"), AllocateOptions()).to_proto()
    assert not proto.devices
    assert dict(proto.envs) == {
        "PCIDEVICE_EXAMPLE_COM_ETH": "0000:c1:00.0",
        "PCIDEVICE_EXAMPLE_COM_ETH_INFO": '{"0000:c1:00.0":{"generic":{"deviceID":"0000:c1:00.0"}}}',
    }


def test_gpu_payload_with_and_without_cdi() -> None:
    pool = _pool("nvidia.com/gpu")
    devices = _devices(pool, GPU_UUIDS[2], GPU_UUIDS[0])
    plain = build_container_payload(pool, devices, AllocateOptions()).to_proto()
    assert dict(plain.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{GPU_UUIDS[2]},{GPU_UUIDS[0]}"}
    assert not plain.cdi_devices and not plain.devices
    options = AllocateOptions.from_config(DevicePluginConfig(gpu_cdi=True, gpu_cdi_kind="nvidia.com/gpu"))
    cdi = build_container_payload(pool, devices, options).to_proto()
    assert [d.name for d in cdi.cdi_devices] == [f"nvidia.com/gpu={GPU_UUIDS[2]}",
                                                 f"nvidia.com/gpu={GPU_UUIDS[0]}"]
    assert cdi.envs["NVIDIA_VISIBLE_DEVICES"] == f"{GPU_UUIDS[2]},{GPU_UUIDS[0]}"
