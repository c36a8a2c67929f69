"""Exact GPU-NIC pairing from the kubelet's facts, end to end over unix sockets.

The stand-in kubelet admits pods resource by resource in a random order and serves PodResources v1; the agent's
device-plugin manager serves the devices and, in every preference call, asks the ownership service (real gRPC
client, pod specs as the own-node pod watch gives them) which devices of the other kind the container already
holds. Checked on churn with 20 % single-resource pods and an agent restart in the middle:
- joint mode (the agent serves GPUs and VFs): every GPU+NIC container is PIX whenever a PIX pair was free when
  its admission started;
- NIC-only mode (a stand-in for NVIDIA's plugin serves GPUs by UUID and picks them itself): every container
  whose GPU came first gets a PIX VF whenever one under its GPU's switch was free;
- no preference ever names a device the kubelet did not offer;
- with the PodResources API away, slow or answering garbage the agent keeps serving (its own policy).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.deviceplugin.facts import OwnershipFacts
from agent.deviceplugin.manager import DevicePluginManager
from agent.host.podresources import Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.host.podresources.ratelimit import TokenBucket
from agent.kube.model import PodView
from agent.ownership.service import OwnershipService
from agent.placement.policy import achieved_levels
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import FAST, dp_config
from tests.fakes.apiserver import container_spec
from tests.fakes.standin_plugin import StandInPlugin

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    return simulated_topology("pcie-pairs", Path(tmp_path_factory.mktemp("pairs")))


def pix(topology: Topology, gpu: str, vf: str) -> bool:
    return achieved_levels(topology, [gpu], [vf]) == [Level.PIX]


@dataclass
class Node:
    """Stand-in kubelet (with PodResources), the agent's manager with ownership facts, optionally NVIDIA's plugin."""

    directory: Path
    topology: Topology
    serve_gpus: bool
    kubelet: LocalKubelet = field(init=False)
    specs: dict[tuple[str, str], PodView] = field(default_factory=dict)
    manager: DevicePluginManager | None = None
    service: OwnershipService | None = None
    nvidia: StandInPlugin | None = None
    now: float = 0.0  # the client's rate-limit clock: the kubelet admits a pod every 0.1 s here
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)


    def __post_init__(self) -> None:
        self.kubelet = LocalKubelet(self.directory / "dp", rng=random.Random(7),  # noqa: S311
                                    pod_resources_socket=self.directory / "pr" / "kubelet.sock")
        assert self.kubelet.pod_resources is not None  # its rate limit runs on the same admission clock
        self.kubelet.pod_resources.bucket = TokenBucket(100, 10, monotonic=lambda: self.now)

    async def start_agent(self) -> None:
        """A (re)started agent: a fresh manager, allocator and ownership service."""
        assert self.kubelet.pod_resources is not None
        self.registry = registry = CollectorRegistry()
        client = KubeletPodResources(self.kubelet.pod_resources.socket_path,
                                     reachability=Reachability(registry, "test"),
                                     bucket=TokenBucket(monotonic=lambda: self.now))
        self.service = OwnershipService(client, pod_specs=lambda: self.specs, registry=registry, lookup_timeout=1.0)
        config = dp_config(str(self.directory / "dp"), serve_gpus=self.serve_gpus)
        self.manager = DevicePluginManager(config, self.topology, registry=registry, **FAST,
                                           plugin_registry_dir=str(self.directory / "reg"),
                                           cdi_spec_dir=str(self.directory / "cdi"))
        self.manager.use_ownership(OwnershipFacts(self.service, self.manager.pools, GPU))
        await self.manager.start()
        await self.kubelet.wait_for(lambda: all(r in self.kubelet.plugins and self.kubelet.plugins[r].lists > 0
                                                and self.kubelet.plugins[r].connected for r in (GPU, NIC)))
        await self.service.refresh()  # what the ownership subsystem does first

    async def stop_agent(self) -> None:
        if self.manager is not None:
            await self.manager.stop()
        if self.service is not None:
            await self.service.port.aclose()

    def gpu_ids(self) -> list[str]:
        return sorted(g.uuid for g in self.topology.gpus if g.uuid)

    def free(self, resource: str) -> set[str]:
        return self.kubelet.plugins[resource].healthy() - self.kubelet.allocated.get(resource, set())

    def pod(self, name: str, requests: dict[str, int]) -> tuple[str, str]:
        self.specs[("ml", name)] = PodView.from_dict({"metadata": {"namespace": "ml", "name": name},
                                                      "spec": {"containers": [container_spec("main", requests)]}})
        return "ml", name


@pytest.fixture
async def node_factory(pairs: Topology) -> AsyncIterator:
    made: list[Node] = []

    async def make(serve_gpus: bool) -> Node:
        node = Node(Path(tempfile.mkdtemp(prefix="gnapair")), pairs, serve_gpus)
        made.append(node)
        await node.kubelet.start()
        if not serve_gpus:
            node.nvidia = StandInPlugin(node.directory / "dp", GPU, node.gpu_ids(), rng=random.Random(3))  # noqa: S311
            await node.nvidia.start()
        await node.start_agent()
        return node

    yield make
    for node in made:
        await node.stop_agent()
        if node.nvidia is not None:
            await node.nvidia.stop()
        await node.kubelet.stop()
        shutil.rmtree(node.directory, ignore_errors=True)


async def churn(node: Node, steps: int, seed: int) -> dict[str, list[bool]]:
    """Admit and end pods; per kind of GPU+NIC admission ('gpu-first'/'nic-first'), whether the promise held."""
    rng = random.Random(seed)  # noqa: S311
    live: list[tuple[str, str]] = []
    held: dict[str, list[bool]] = {"gpu-first": [], "nic-first": []}
    for step in range(steps):
        node.now += 0.1
        if step == steps // 2:
            await node.stop_agent()  # the agent restarts in the middle of the churn; the kubelet keeps its records
            await node.start_agent()
        if live and (len(live) >= 6 or rng.random() < 0.35):
            node.kubelet.end_pod(*live.pop(rng.randrange(len(live))))
            continue
        roll = rng.random()
        requests = {GPU: 1} if roll < 0.1 else {NIC: 1} if roll < 0.2 else {GPU: 1, NIC: 1}
        order = [GPU, NIC] if rng.random() < 0.5 else [NIC, GPU]
        order = [r for r in order if r in requests]
        free_gpus, free_vfs = node.free(GPU), node.free(NIC)
        pix_free = any(pix(node.topology, g, v) for g in free_gpus for v in free_vfs)
        key = node.pod(f"p{step}", requests)
        try:
            got = await node.kubelet.admit(requests, order=order, pod=key)
        except AdmissionError:
            continue
        live.append(key)
        if len(requests) < 2:
            continue
        gpu, vf = got[GPU][0], got[NIC][0]
        first = "gpu-first" if order[0] == GPU else "nic-first"
        if node.serve_gpus:
            held[first].append(pix(node.topology, gpu, vf) or not pix_free)
        elif first == "gpu-first":  # NIC-only: the promise is about VFs under the GPU the other plugin chose
            held[first].append(pix(node.topology, gpu, vf) or not any(pix(node.topology, gpu, v) for v in free_vfs))
    return held


def offered_only(node: Node) -> None:
    for resource, offered, preferred in node.kubelet.preferences:
        assert set(preferred) <= offered, f"{resource}: preferred {preferred} outside the offer"


async def test_joint_mode_every_pair_is_pix_when_one_was_free(node_factory) -> None:
    node = await node_factory(serve_gpus=True)
    held = await churn(node, steps=80, seed=11)
    assert held["gpu-first"] and held["nic-first"]
    assert all(held["gpu-first"]), held
    assert all(held["nic-first"]), held
    offered_only(node)


async def test_nic_only_mode_gpu_first_containers_get_a_pix_vf(node_factory) -> None:
    node = await node_factory(serve_gpus=False)
    held = await churn(node, steps=80, seed=5)
    assert held["gpu-first"] and all(held["gpu-first"]), held
    offered_only(node)


@pytest.mark.parametrize("fault", ["absent", "slow", "garbage"])
async def test_pod_resources_faults_fall_back_to_the_agents_policy(node_factory, fault: str) -> None:
    node = await node_factory(serve_gpus=True)
    server = node.kubelet.pod_resources
    assert server is not None and node.service is not None
    node.service.lookup_timeout = 0.02
    if fault == "absent":
        await server.stop()
    elif fault == "slow":
        server.hold = lambda: asyncio.sleep(0.5)
    else:
        server.garbage = True
    for step in range(6):
        node.now += 0.1
        requests = {GPU: 1, NIC: 1}
        got = await node.kubelet.admit(requests, order=[GPU, NIC] if step % 2 else [NIC, GPU],
                                       pod=node.pod(f"f{step}", requests))
        assert len(got[GPU]) == 1 and len(got[NIC]) == 1
    assert node.registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "failed"}) >= 6
    assert node.registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "exact"}) is None
    offered_only(node)
