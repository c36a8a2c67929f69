"""Shared fixtures for the device-plugin tests: short socket directories, a small node, a stand-in kubelet."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import (
    Gpu,
    Location,
    Nic,
    PciInfo,
    RdmaCharDevices,
    RdmaPort,
    Topology,
    Vf,
)

FAST = {"poll_interval": 0.05, "backoff_initial": 0.05, "backoff_max": 0.2, "register_timeout": 2.0}
GPU_UUIDS = tuple(f"GPU-{i:08x}-1111-2222-3333-44445555666{i}" for i in range(4))


def _vf(pf_bus: int, index: int, rdma_index: int) -> Vf:
    bus_id = f"0000:{pf_bus:02x}:00.{index + 2}" if index < 6 else f"0000:{pf_bus:02x}:01.{index - 6}"
    return Vf(
        pci=PciInfo(bus_id=bus_id, vendor="0x15b3", device="0x101e", pci_class="0x020700",
                    driver="mlx5_core"),
        pf_bus_id=f"0000:{pf_bus:02x}:00.0", vf_index=index, rdma=f"mlx5_{rdma_index}",
        netdevs=(f"ib{pf_bus}v{index}",),
        chardevs=RdmaCharDevices(uverbs=f"uverbs{rdma_index}", umad=(f"umad{rdma_index}",),
                                 issm=(f"issm{rdma_index}",)),
        ports=(RdmaPort(number=1, state="ACTIVE", link_layer="InfiniBand"),),
    )


def rdma_pf(pf_bus: int, rdma_index: int, numa: int | None, vfs: int, netdev: str) -> Nic:
    """An InfiniBand PF at bus `pf_bus` with `vfs` VFs whose RDMA devices follow `rdma_index`."""
    return Nic(
        pci=PciInfo(bus_id=f"0000:{pf_bus:02x}:00.0", vendor="0x15b3", device="0x101d", pci_class="0x020700",
                    driver="mlx5_core"),
        location=Location(root=f"pci0000:{pf_bus - 1:02x}", switches=(f"sw{pf_bus}",), numa=numa),
        rdma=f"mlx5_{rdma_index}", netdevs=(netdev,), link_type="infiniband",
        chardevs=RdmaCharDevices(uverbs=f"uverbs{rdma_index}"),
        ports=(RdmaPort(number=1, state="ACTIVE", link_layer="InfiniBand"),),
        sriov_totalvfs=8, vfs=tuple(_vf(pf_bus, i, rdma_index + 1 + i) for i in range(vfs)),
    )


def small_topology(vfs_per_pf: int = 3, gpu_without_uuid: bool = False,
                   numa_unknown: bool = False) -> Topology:
    """4 GPUs, 2 IB PFs with VFs (NUMA 0 and 1), 1 Ethernet PF without RDMA and without VFs."""
    gpus = tuple(
        Gpu(index=i, pci=PciInfo(bus_id=f"0000:{0x18 + i * 0x10:02x}:00.0", vendor="0x10de", device="0x2330"),
            location=Location(root=f"pci0000:{0x17 + i * 0x10:02x}", numa=None if numa_unknown else i // 2),
            uuid=None if gpu_without_uuid and i == 3 else GPU_UUIDS[i])
        for i in range(4))
    nics = (
        rdma_pf(0x1a, 0, None if numa_unknown else 0, vfs_per_pf, "ibp26s0"),
        rdma_pf(0x9a, 10, None if numa_unknown else 1, vfs_per_pf, "ibp154s0"),
        Nic(pci=PciInfo(bus_id="0000:c1:00.0", vendor="0x8086", device="0x1592", pci_class="0x020000",
                        driver="ice"),
            location=Location(root="pci0000:c0", numa=1), netdevs=("eno1",), link_type="ether"),
    )
    return Topology(gpus=gpus, nics=nics, source="test")


def without_nic(topology: Topology, bus_id: str) -> Topology:
    """The topology with one PF (and its VFs) gone."""
    return replace(topology, nics=tuple(n for n in topology.nics if n.bus_id != bus_id))


@pytest.fixture
def sockdir() -> Iterator[str]:
    """A short directory for unix sockets (pytest's tmp_path can exceed the 107-byte limit)."""
    path = tempfile.mkdtemp(prefix="gna")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def kubelet(sockdir: str) -> AsyncIterator[LocalKubelet]:
    """A running stand-in kubelet in `sockdir`."""
    stand_in = LocalKubelet(sockdir)
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


def dp_config(directory: str, **changes: object) -> DevicePluginConfig:
    """Device-plugin config for tests: GPUs served, sockets in `directory`."""
    config = DevicePluginConfig(device_plugin_dir=directory, serve_gpus=True,
                                device_info_dir=f"{directory}/devinfo")
    return replace(config, **changes)


@pytest.fixture
async def make_manager() -> AsyncIterator[Callable[..., Awaitable[DevicePluginManager]]]:
    """Start managers with fast intervals; every one is stopped at teardown."""
    started: list[DevicePluginManager] = []

    async def make(config: DevicePluginConfig, topology: Topology | None = None,
                   **options: object) -> DevicePluginManager:
        defaults = {"plugin_registry_dir": f"{config.device_plugin_dir}/plugins_registry",
                    "cdi_spec_dir": f"{config.device_plugin_dir}/cdi"}
        manager = DevicePluginManager(config, topology or small_topology(), **{**FAST, **defaults, **options})
        started.append(manager)
        await manager.start()
        return manager

    yield make
    for manager in started:
        await manager.stop()


async def first_list(channel: grpc.aio.Channel) -> tuple[grpc.aio.UnaryStreamCall, list[api_pb2.Device]]:
    """Open ListAndWatch and read its first message."""
    call = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty())
    response = await asyncio.wait_for(call.read(), 5)
    return call, list(response.devices)


# simulated DGX H100 nodes, built once per test module: 8 whole GPUs, and GPUs 0-3 in MIG mode (seven 1g.10gb each)
@pytest.fixture(scope="module")
def dgx(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    return simulated_topology("dgx-h100", Path(tmp_path_factory.mktemp("dgx")))


@pytest.fixture(scope="module")
def mig_node(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    return simulated_topology("dgx-h100-mig", Path(tmp_path_factory.mktemp("mig")))
