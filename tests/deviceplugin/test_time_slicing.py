"""GPU time-slicing from NVIDIA's config file (`--nvidia-dp-config`, `sharing.timeSlicing`), through the stand-in
kubelet: NVIDIA's README examples (tests/deviceplugin/data/nvidia/SOURCES.md) on the simulated dgx-h100 (8 GPUs)
and dgx-h100-mig. What NVIDIA's plugin does is read from its source (internal/rm/device_map.go
`updateDeviceMapWithReplicas`, rm.go `ValidateRequest`, allocate.go `greedyAlloc`, plugin/server.go
`uniqueDeviceIDsFromAnnotatedDeviceIDs`)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agent.config.load import load
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.placement.policy import achieved_levels
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import dp_config

DATA = Path(__file__).parent / "data" / "nvidia"
GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIG = "nvidia.com/mig-1g.10gb"
RDMA = "gpunodeagent.io/sriov_rdma"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]


def nvidia_config(path: Path, directory: str, **changes: object):
    """The device-plugin settings NVIDIA's file gives (read as `run` reads it), with the test's sockets."""
    plugin = load(None, {"GPU_NODE_AGENT_NVIDIA_DP_CONFIG": str(path)}).device_plugin
    return replace(plugin, **{**{f: getattr(dp_config(directory), f) for f in
                                 ("device_plugin_dir", "serve_gpus", "device_info_dir")}, **changes})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "nvidia-dp.yaml"
    path.write_text(text)
    return path


async def serve(kubelet: LocalKubelet, make_manager: MakeManager, config, topology: Topology) -> DevicePluginManager:
    manager = await make_manager(config, topology)
    await kubelet.wait_for(lambda: all(name in kubelet.plugins and kubelet.plugins[name].lists > 0
                                       for name in manager.resources), 10)
    return manager


async def test_readme_example_serves_ten_replicas_of_each_gpu(kubelet: LocalKubelet, make_manager: MakeManager,
                                                               dgx: Topology) -> None:
    """README: "a node with 8 GPUs ... would now advertise 80 nvidia.com/gpu resources"."""
    config = nvidia_config(DATA / "readme-time-slicing.yaml", str(kubelet.directory))
    await serve(kubelet, make_manager, config, dgx)
    assert set(kubelet.plugins[GPU].devices) == {f"{g.uuid}::{n}" for g in dgx.gpus for n in range(10)}
    assert SHARED not in kubelet.plugins
    assert {d.topology.nodes[0].ID for d in kubelet.plugins[GPU].devices.values()} == {0, 1}  # the GPU's NUMA


async def test_readme_renamed_example_serves_gpu_shared(kubelet: LocalKubelet, make_manager: MakeManager,
                                                        dgx: Topology) -> None:
    config = nvidia_config(DATA / "readme-time-slicing-renamed.yaml", str(kubelet.directory))
    manager = await serve(kubelet, make_manager, config, dgx)
    assert len(kubelet.plugins[SHARED].devices) == 80 and GPU not in manager.resources
    ids = (await kubelet.admit({SHARED: 1}))[SHARED]
    assert dict(kubelet.responses[SHARED].envs) == {"NVIDIA_VISIBLE_DEVICES": ids[0].partition("::")[0]}


async def test_two_replicas_are_refused_with_fail_requests_greater_than_one(
        kubelet: LocalKubelet, make_manager: MakeManager, dgx: Topology, tmp_path: Path) -> None:
    path = write(tmp_path, "version: v1\nsharing:\n  timeSlicing:\n    failRequestsGreaterThanOne: true\n"
                           "    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n")
    await serve(kubelet, make_manager, nvidia_config(path, str(kubelet.directory)), dgx)
    with pytest.raises(AdmissionError, match=re.escape(
            "INVALID_ARGUMENT: invalid allocation request for 'nvidia.com/gpu': invalid request: maximum request "
            "size for shared resources is 1; found 2")):
        await kubelet.admit({GPU: 2})
    assert len((await kubelet.admit({GPU: 1}))[GPU]) == 1


async def test_two_replicas_of_one_gpu_carry_its_uuid_once(kubelet: LocalKubelet, make_manager: MakeManager,
                                                           dgx: Topology) -> None:
    """NVIDIA's getAllocateResponse passes unique device IDs: the GPU's UUID once, one /dev/nvidia<minor>."""
    config = nvidia_config(DATA / "readme-time-slicing.yaml", str(kubelet.directory))
    await serve(kubelet, make_manager, config, dgx)
    gpu = dgx.gpus[3]
    reply = await kubelet.plugins[GPU].stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[f"{gpu.uuid}::1", f"{gpu.uuid}::7"])]))
    assert dict(reply.container_responses[0].envs) == {"NVIDIA_VISIBLE_DEVICES": gpu.uuid}


@pytest.mark.parametrize(("policy", "gpus"), [("distributed", 3), ("packed", 1)])
async def test_preferred_replicas_spread_or_pack_as_nvidias(kubelet: LocalKubelet, make_manager: MakeManager,
                                                            dgx: Topology, policy: str, gpus: int) -> None:
    """allocate.go: distributed picks the GPU with the fewest replicas allocated, packed the one with the most."""
    config = nvidia_config(DATA / "readme-time-slicing.yaml", str(kubelet.directory),
                           shared_devices_allocation_policy=policy)
    await serve(kubelet, make_manager, config, dgx)
    got = [(await kubelet.admit({GPU: 1}))[GPU][0] for _ in range(3)]
    assert len({i.partition("::")[0] for i in got}) == gpus
    two = (await kubelet.admit({GPU: 2}))[GPU]
    assert len({i.partition("::")[0] for i in two}) == (2 if policy == "distributed" else 1)


@pytest.mark.parametrize("order", [[GPU, RDMA], [RDMA, GPU]])
async def test_a_replica_and_a_nic_sit_under_one_switch(kubelet: LocalKubelet, make_manager: MakeManager,
                                                        dgx: Topology, order: list[str]) -> None:
    """Replicas of one GPU are one device for topology: the VF goes under the GPU's switch, and a replica goes
    under the VF's."""
    config = nvidia_config(DATA / "readme-time-slicing.yaml", str(kubelet.directory))
    await serve(kubelet, make_manager, config, dgx)
    for _ in range(6):
        got = await kubelet.admit({GPU: 1, RDMA: 1}, order)
        assert achieved_levels(dgx, got[GPU], got[RDMA]) == [Level.PIX], got


async def test_mig_devices_are_time_sliced_by_their_resource_name(kubelet: LocalKubelet, make_manager: MakeManager,
                                                                  tmp_path: Path, mig_node: Topology) -> None:
    node = mig_node
    path = write(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
                           "    - name: mig-1g.10gb\n      replicas: 2\n")
    await serve(kubelet, make_manager, nvidia_config(path, str(kubelet.directory)), node)
    migs = {m.uuid for g in node.gpus for m in g.mig_devices}
    assert set(kubelet.plugins[MIG].devices) == {f"{m}::{n}" for m in migs for n in range(2)}
    assert len(kubelet.plugins[GPU].devices) == 4  # the whole GPUs are not shared
    ids = (await kubelet.admit({MIG: 1}))[MIG]
    assert dict(kubelet.responses[MIG].envs) == {"NVIDIA_VISIBLE_DEVICES": ids[0].partition("::")[0]}


async def test_a_name_this_node_does_not_serve_is_said_once(kubelet: LocalKubelet, make_manager: MakeManager,
                                                            dgx: Topology, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: mig-3g.40gb\n"
                           "      replicas: 2\n")
    manager = await serve(kubelet, make_manager, nvidia_config(path, str(kubelet.directory)), dgx)
    await manager.update_topology(dgx)
    assert caplog.text.count("nvidia.com/mig-3g.40gb is not served on this node") == 1
    assert len(kubelet.plugins[GPU].devices) == 8
