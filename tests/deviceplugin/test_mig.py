"""MIG strategies as NVIDIA's plugin serves them (internal/rm/device_map.go, rm.go `AddDefaultResourcesToConfig`),
through the stand-in kubelet on the simulated profile dgx-h100-mig (GPUs 0-3 in MIG mode with seven 1g.10gb
MIG devices each, GPUs 4-7 whole)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.nvidia import GpuServing, gpu_payload
from agent.simulate.kubelet import LocalKubelet
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import dp_config

GPU = "nvidia.com/gpu"
MIG = "nvidia.com/mig-1g.10gb"
RDMA = "gpunodeagent.io/sriov_rdma"
NOT_SERVED = "gpu_node_agent_devices_not_served"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]


def all_mig(topology: Topology) -> Topology:
    """Every GPU in MIG mode with the same seven 1g.10gb devices (GPU i's copies of GPU i % 4's)."""
    parts = [g for g in topology.gpus if g.mig_enabled]
    gpus = tuple(g if g.mig_enabled else replace(g, mig_enabled=True, mig_devices=tuple(
        replace(m, uuid=m.uuid.replace("MIG-", "MIG-c")) for m in parts[g.index % 4].mig_devices))
        for g in topology.gpus)
    return replace(topology, gpus=gpus)


async def serve(kubelet: LocalKubelet, make_manager: MakeManager, topology: Topology, strategy: str,
                **settings: object) -> DevicePluginManager:
    manager = await make_manager(dp_config(str(kubelet.directory), mig_strategy=strategy, **settings), topology)
    await kubelet.wait_for(lambda: all(name in kubelet.plugins and kubelet.plugins[name].lists > 0
                                       for name in manager.resources), 10)
    return manager


async def test_none_serves_eight_whole_gpus(kubelet: LocalKubelet, make_manager: MakeManager,
                                            mig_node: Topology) -> None:
    manager = await serve(kubelet, make_manager, mig_node, "none")
    assert set(kubelet.plugins[GPU].devices) == {g.uuid for g in mig_node.gpus}
    assert MIG not in kubelet.plugins
    assert manager.metrics.registry.get_sample_value(NOT_SERVED, {"reason": "mig"}) == 0


async def test_mixed_serves_whole_gpus_and_one_resource_per_profile(kubelet: LocalKubelet,
                                                                    make_manager: MakeManager,
                                                                    mig_node: Topology) -> None:
    await serve(kubelet, make_manager, mig_node, "mixed")
    assert set(kubelet.plugins[GPU].devices) == {g.uuid for g in mig_node.gpus[4:]}
    migs = {m.uuid for g in mig_node.gpus[:4] for m in g.mig_devices}
    assert len(migs) == 28 and set(kubelet.plugins[MIG].devices) == migs
    ids = (await kubelet.admit({MIG: 2}))[MIG]
    assert all(i.startswith("MIG-") for i in ids)
    assert dict(kubelet.responses[MIG].envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}


async def test_mixed_index_ids_and_cdi_names(kubelet: LocalKubelet, make_manager: MakeManager,
                                             mig_node: Topology) -> None:
    await serve(kubelet, make_manager, mig_node, "mixed", device_list_strategy=["envvar", "cdi-cri"],
                device_id_strategy="index")
    ids = (await kubelet.admit({MIG: 1}))[MIG]
    parent, mig = mig_node.mig_device(ids[0])
    assert dict(kubelet.responses[MIG].envs) == {"NVIDIA_VISIBLE_DEVICES": f"{parent.index}:{mig.index}"}
    assert [d.name for d in kubelet.responses[MIG].cdi_devices] == [f"nvidia.com/gpu={parent.index}:{mig.index}"]


async def test_single_on_a_mixed_node_serves_no_gpu_and_says_why(kubelet: LocalKubelet, make_manager: MakeManager,
                                                                  mig_node: Topology,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """NVIDIA's plugin exits on this node ("all devices on the node must be configured with the same
    migEnabled value"); the agent serves no GPU resource, keeps its NICs, logs one line and counts."""
    with caplog.at_level(logging.WARNING):
        manager = await serve(kubelet, make_manager, mig_node, "single")
        await manager.update_topology(mig_node)  # the same again: no second line
    assert GPU not in manager.resources and MIG not in manager.resources and RDMA in manager.resources
    assert manager.metrics.registry.get_sample_value(NOT_SERVED, {"reason": "mig_strategy"}) == 8
    assert caplog.text.count("same migEnabled value") == 1


async def test_single_on_an_all_mig_node_serves_mig_devices_as_gpus(kubelet: LocalKubelet,
                                                                     make_manager: MakeManager,
                                                                     mig_node: Topology) -> None:
    node = all_mig(mig_node)
    manager = await serve(kubelet, make_manager, node, "single")
    assert set(kubelet.plugins[GPU].devices) == {m.uuid for g in node.gpus for m in g.mig_devices}
    assert len(kubelet.plugins[GPU].devices) == 56 and MIG not in manager.resources
    assert manager.metrics.registry.get_sample_value(NOT_SERVED, {"reason": "mig_strategy"}) == 0


def test_single_refuses_two_profiles(mig_node: Topology) -> None:
    from agent.deviceplugin.pools import build_pools

    node = all_mig(mig_node)
    gpu0 = node.gpus[0]
    odd = replace(gpu0, mig_devices=(replace(gpu0.mig_devices[0], profile="2g.20gb", gpu_slices=2),))
    node = replace(node, gpus=(odd, *node.gpus[1:]))
    scan = build_pools(node, dp_config("/tmp", mig_strategy="single"))
    assert not next(p for p in scan.pools if p.resource_name == GPU).devices
    assert any("more than one MIG device type" in line for line in scan.skipped)


def test_mig_devices_pass_parent_node_and_capability_nodes(tmp_path: Path, mig_node: Topology) -> None:
    """nvml_devices.go GetPaths: the parent's /dev/nvidia<minor>, then the GI and CI access capabilities from
    /proc/driver/nvidia-caps/mig-minors (lines `gpu<minor>/gi<G>/access <N>`, `gpu<minor>/gi<G>/ci<C>/access <N>`)."""
    gpu = replace(mig_node.gpus[1], minor=1)
    mig = gpu.mig_devices[2]  # GPU instance 3, compute instance 0
    minors = tmp_path / "mig-minors"
    minors.write_text("config 1\nmonitor 2\ngpu1/gi3/access 165\ngpu1/gi3/ci0/access 166\ngpu1/gi4/access 174\n")
    payload = gpu_payload([(gpu, mig)], GpuServing(pass_device_specs=True, dev_root=str(tmp_path),
                                                   mig_minors=str(minors)))
    assert payload.envs == {"NVIDIA_VISIBLE_DEVICES": mig.uuid}
    assert [c for c, _ in payload.devices if "nvidiactl" not in c and "uvm" not in c and "modeset" not in c] == [
        "/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap165", "/dev/nvidia-caps/nvidia-cap166"]


@pytest.mark.parametrize("order", [[MIG, RDMA], [RDMA, MIG]])
async def test_a_mig_device_and_a_nic_sit_under_one_switch(kubelet: LocalKubelet, make_manager: MakeManager,
                                                           mig_node: Topology, order: list[str]) -> None:
    """A MIG device inherits its parent GPU's PCIe position: the container's VF is under the same switch."""
    from agent.placement.policy import achieved_levels

    await serve(kubelet, make_manager, mig_node, "mixed")
    for _ in range(6):
        got = await kubelet.admit({MIG: 1, RDMA: 1}, order)
        assert achieved_levels(mig_node, got[MIG], got[RDMA]) == [Level.PIX], got
