"""Replicas of one time-sliced GPU are one device for health: a kernel-log Xid 79 on the GPU turns all ten of its
replicas Unhealthy in ListAndWatch and no other GPU's (kmsg -> HealthService -> DevicePluginManager -> the
stand-in kubelet, on the simulated dgx-h100 with NVIDIA's README time-slicing example)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.config.load import load
from agent.deviceplugin.manager import DevicePluginManager
from agent.health.service import HealthService
from agent.host.links import SysfsLinkPort
from agent.signals import DeviceHealth
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.simulate.node import SimulatedNode
from tests.health.conftest import TIMEOUT, XID_79, fast_config

EXAMPLE = Path(__file__).parent.parent / "deviceplugin" / "data" / "nvidia" / "readme-time-slicing.yaml"
GPU = "nvidia.com/gpu"



async def test_an_xid_on_a_gpu_withdraws_all_its_replicas(node: SimulatedNode, kubelet: LocalKubelet, kmsg_file: Path,
                                                          boot_id_file: Path, tmp_path: Path) -> None:
    topology = node.topology()
    device_health = DeviceHealth()
    config = replace(load(None, {"CONFIG_FILE": str(EXAMPLE)}).device_plugin,
                     device_plugin_dir=str(kubelet.directory), serve_gpus=True, device_info_dir="")
    manager = DevicePluginManager(config, topology, device_health=device_health, poll_interval=0.05,
                                  backoff_initial=0.05, backoff_max=0.2, register_timeout=2.0)
    health = HealthService(fast_config(kmsg_file), tmp_path / "state", topology, node.nvml, device_health,
                           CollectorRegistry(), SysfsLinkPort(node.sysfs_root), boot_id_path=boot_id_file,
                           kmsg_file_poll_interval=0.01, housekeeping_interval=0.05)
    stop = asyncio.Event()
    await manager.start()
    running = asyncio.create_task(health.run(stop))
    try:
        await asyncio.wait_for(health.first_pass_done.wait(), TIMEOUT)
        await kubelet.wait_for(lambda: GPU in kubelet.plugins and len(kubelet.plugins[GPU].healthy()) == 80, TIMEOUT)
        gpu = topology.gpus[2]
        with kmsg_file.open("a") as log:
            log.write(XID_79.format(seq=1, bus=gpu.bus_id[:-2]))
        await kubelet.wait_for(lambda: len(kubelet.plugins[GPU].healthy()) == 70, TIMEOUT)
        listed = kubelet.plugins[GPU].health()
        assert {i for i, h in listed.items() if h == "Unhealthy"} == {f"{gpu.uuid}::{n}" for n in range(10)}
        with pytest.raises(AdmissionError, match="requested number of devices unavailable"):
            await kubelet.admit({GPU: 71})
    finally:
        stop.set()
        await asyncio.wait_for(running, TIMEOUT)
        await manager.stop()
