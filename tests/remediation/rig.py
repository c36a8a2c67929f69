"""A node for device-scoped remediation tests: the health assessor on a dgx-h100 topology, a stand-in kubelet
whose pods hold GPUs (PodResources over its unix socket, read by the real gRPC client) and the ownership service."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prometheus_client import CollectorRegistry

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.host.nvml import SimulatedNvml
from agent.host.podresources import Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.ownership.service import OwnershipService
from agent.signals import DeviceHealth, NodeVerdict
from agent.simulate import profiles
from agent.simulate.kubelet import LocalKubelet
from agent.simulate.node import build_simulated_node
from agent.topology.load import load_topology
from tests.fakes.standin_plugin import StandInPlugin

if TYPE_CHECKING:
    from tests.remediation.conftest import Harness

GPU = "nvidia.com/gpu"


class Rig:
    """Health (assessor on a dgx-h100 topology), a stand-in kubelet whose pods hold GPUs, and ownership."""

    def __init__(self, directory: Path) -> None:
        root = directory / "sys"
        build_simulated_node("dgx-h100", root)
        uuids = SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids).gpu_uuids()
        self.topology = load_topology(root, uuids)
        self.gpus = [gpu.uuid or "" for gpu in self.topology.gpus]
        self.assessor = HealthAssessor(HealthConfig(), self.topology, DeviceHealth(), clock=lambda: 0.0)
        self.kubelet = LocalKubelet(directory / "dp", pod_resources_socket=directory / "pr" / "kubelet.sock")
        self.plugin = StandInPlugin(directory / "dp", GPU, self.gpus)  # no rng: the lowest free IDs
        assert self.kubelet.pod_resources is not None
        self.ownership = OwnershipService(
            KubeletPodResources(self.kubelet.pod_resources.socket_path,
                                reachability=Reachability(CollectorRegistry(), "test")),
            registry=CollectorRegistry(), lookup_timeout=1.0)

    def kubelet_calls(self) -> int:
        """PodResources calls the stand-in kubelet has served (for the harness's settle)."""
        served = self.kubelet.pod_resources
        return sum(served.calls.values()) if served is not None else 0

    async def start(self) -> None:
        await self.kubelet.start()
        await self.plugin.start()
        await self.kubelet.wait_for(lambda: GPU in self.kubelet.plugins
                                    and len(self.kubelet.plugins[GPU].devices) == len(self.gpus))

    async def stop(self) -> None:
        await self.ownership.port.aclose()
        await self.plugin.stop()
        await self.kubelet.stop()

    async def run_pods(self, harness: Harness, names: list[str], namespace: str = "ml",
                       labels: dict[str, str] | None = None) -> dict[str, int]:
        """One single-GPU pod per name, admitted by the stand-in kubelet; the pods also exist in the API double.
        Returns pod name -> the index of the GPU it holds."""
        held = {}
        for name in names:
            harness.api.add_pod(namespace, name, labels=labels)
            got = await self.kubelet.admit({GPU: 1}, pod=(namespace, name))
            held[name] = self.gpus.index(got[GPU][0])
        await self.ownership.refresh()
        return held

    def xid(self, index: int, code: int) -> NodeVerdict:
        """The kernel log reports Xid `code` on GPU `index`: the assessor's verdict."""
        self.assessor.on_xid(self.assessor.names.by_uuid(self.gpus[index]), code, "kmsg")
        return self.assessor.verdict

    def reset(self, index: int) -> NodeVerdict:
        self.assessor.on_gpu_reset(self.gpus[index], "test: reset observed")
        return self.assessor.verdict


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    directory = Path(tempfile.mkdtemp(prefix="gnaiso"))  # short: the kubelet's unix sockets live here
    rig = Rig(directory)
    await rig.start()
    try:
        yield rig
    finally:
        await rig.stop()
        shutil.rmtree(directory, ignore_errors=True)
