"""End to end: kernel-log Xid -> HealthService -> DevicePluginManager -> ListAndWatch on the stand-in kubelet.

The real device plugin serves a simulated dgx-h100 (GPUs as a resource); appending a real Xid 79 line for one
GPU's bus id to the kmsg file turns that GPU Unhealthy in ListAndWatch and bumps the Xid counter; the GPU's
recovery (NVML loses it, then it is reset and answers again) turns it Healthy again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.health.service import HealthService
from agent.host.links import SysfsLinkPort
from agent.signals import DeviceHealth
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import SimulatedNode
from tests.fakes.polling import until
from tests.health.conftest import TIMEOUT, XID_79, fast_config

GPU_RESOURCE = "nvidia.com/gpu"



def _resource_of(manager: DevicePluginManager, device: str) -> str | None:
    """Which served resource a device belongs to (the wiring app.py uses for the device_healthy metric)."""
    return next((name for name in manager.resources if device in manager.plugin(name).pool.ids), None)


def _listed(kubelet: LocalKubelet, resource: str) -> dict[str, str]:
    view = kubelet.plugins.get(resource)
    return view.health() if view is not None else {}


async def test_xid_79_in_kmsg_flips_listandwatch_and_recovery_flips_it_back(
        node: SimulatedNode, kubelet: LocalKubelet, kmsg_file: Path, boot_id_file: Path, tmp_path: Path) -> None:
    topology = node.topology()
    device_health = DeviceHealth()
    config = DevicePluginConfig(device_plugin_dir=str(kubelet.directory), serve_gpus=True)
    manager = DevicePluginManager(config, topology, device_health=device_health, poll_interval=0.05,
                                  backoff_initial=0.05, backoff_max=0.2, register_timeout=2.0)
    registry = CollectorRegistry()
    health = HealthService(fast_config(kmsg_file), tmp_path / "state", topology, node.nvml, device_health, registry,
                           SysfsLinkPort(node.sysfs_root), boot_id_path=boot_id_file, kmsg_file_poll_interval=0.01,
                           housekeeping_interval=0.05, resource_of=lambda device: _resource_of(manager, device))
    stop = asyncio.Event()
    await manager.start()
    running = asyncio.create_task(health.run(stop))
    try:
        await asyncio.wait_for(health.first_pass_done.wait(), TIMEOUT)
        gpus = {g.uuid for g in topology.gpus}
        await kubelet.wait_for(lambda: _listed(kubelet, GPU_RESOURCE) == dict.fromkeys(gpus, "Healthy"), TIMEOUT)
        rdma = f"{config.resource_prefix}/sriov_rdma"
        await kubelet.wait_for(lambda: len(_listed(kubelet, rdma)) == 64, TIMEOUT)
        gpu = topology.gpus[2]
        labels = {"gpu": "2", "uuid": gpu.uuid, "pci_bus_id": "0000:52:00.0", "xid": "79"}
        assert registry.get_sample_value("gpu_node_agent_xid_errors_total", labels) is None

        with kmsg_file.open("a") as log:
            log.write(XID_79.format(seq=1, bus=gpu.bus_id[:-2]))
        await kubelet.wait_for(lambda: _listed(kubelet, GPU_RESOURCE)[gpu.uuid] == "Unhealthy", TIMEOUT)
        assert registry.get_sample_value("gpu_node_agent_xid_errors_total", labels) == 1
        assert registry.get_sample_value("gpu_node_agent_device_healthy",
                                         {"resource": GPU_RESOURCE, "device": gpu.uuid}) == 0
        assert sum(h == "Healthy" for h in _listed(kubelet, GPU_RESOURCE).values()) == 7
        assert health.verdict.verdict == "drain"

        node.nvml.lose_gpu(gpu.uuid)  # what NVML does after Xid 79
        polls = health.nvml_poll.polls
        await until(lambda: health.nvml_poll.polls >= polls + 2)  # the poller has seen it lost
        assert _listed(kubelet, GPU_RESOURCE)[gpu.uuid] == "Unhealthy"
        node.nvml.reset_gpu(gpu.uuid)  # the node is power-cycled/reset: NVML answers again
        await kubelet.wait_for(lambda: _listed(kubelet, GPU_RESOURCE)[gpu.uuid] == "Healthy", TIMEOUT)
        assert health.verdict.verdict == "healthy"
        assert registry.get_sample_value("gpu_node_agent_xid_errors_total", labels) == 1
    finally:
        stop.set()
        await asyncio.wait_for(running, TIMEOUT)
        await manager.stop()
