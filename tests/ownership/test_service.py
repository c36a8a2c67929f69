"""Ownership over real sockets: the stand-in kubelet admits pods through two plugins and serves PodResources v1;
the ownership service reads it with the real gRPC client.

Checks the kubelet semantics the agent builds on (the container under admission is listed with its first
resource while the kubelet asks about its second; devices go when the pod ends; a kubelet restart), and what
operators see: `gpu_node_agent_device_pod_info` rows on /metrics text, `gpu_node_agent_pod_resources_up`.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.host.podresources import Reachability
from agent.host.podresources.client import KubeletPodResources
from agent.kube.model import PodView
from agent.ownership.admitted import Admission
from agent.ownership.service import OwnershipService
from agent.simulate.kubelet import LocalKubelet
from tests.fakes.apiserver import container_spec
from tests.fakes.standin_plugin import StandInPlugin

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
GPUS = [f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}" for i in range(4)]
VFS = [f"0000:1a:00.{i}" for i in range(2, 6)]


class Node:
    """A stand-in kubelet with PodResources, a GPU plugin, a NIC plugin that looks up its admission."""

    def __init__(self, directory: Path) -> None:
        self.kubelet = LocalKubelet(directory / "dp", pod_resources_socket=directory / "pr" / "kubelet.sock")
        self.registry = CollectorRegistry()
        self.specs: dict[tuple[str, str], PodView] = {}
        assert self.kubelet.pod_resources is not None
        client = KubeletPodResources(self.kubelet.pod_resources.socket_path,
                                     reachability=Reachability(self.registry, "test"))
        self.service = OwnershipService(client, pod_specs=lambda: self.specs, registry=self.registry,
                                        lookup_timeout=1.0)
        self.seen: dict[str, list[Admission | None]] = {GPU: [], NIC: []}
        self.gpu = StandInPlugin(directory / "dp", GPU, GPUS, during_preference=self._looker(GPU, NIC))
        self.nic = StandInPlugin(directory / "dp", NIC, VFS, during_preference=self._looker(NIC, GPU))

    def _looker(self, resource: str, partner: str):
        async def look(_available: object) -> None:
            self.seen[resource].append(await self.service.admission(resource, [partner]))
        return look

    def pod(self, name: str, **limits: int) -> tuple[str, str]:
        spec = {"metadata": {"namespace": "ml", "name": name, "uid": f"uid-{name}"},
                "spec": {"containers": [container_spec("main", {GPU if k == "gpu" else NIC: v
                                                                 for k, v in limits.items()})]}}
        self.specs[("ml", name)] = PodView.from_dict(spec)
        return "ml", name

    def metric_rows(self) -> set[tuple[str, ...]]:
        text = generate_latest(self.registry).decode()
        return {tuple(s.labels[k] for k in ("resource", "device", "namespace", "pod", "container"))
                for family in text_string_to_metric_families(text) if family.name == "gpu_node_agent_device_pod_info"
                for s in family.samples if s.value == 1}

    def gauge(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    directory = Path(tempfile.mkdtemp(prefix="gnaow"))
    node = Node(directory)
    await node.kubelet.start()
    await node.gpu.start()
    await node.nic.start()
    await node.kubelet.wait_for(lambda: all(len(p.devices) == 4 for p in node.kubelet.plugins.values())
                                and len(node.kubelet.plugins) == 2)
    try:
        yield node
    finally:
        await node.service.port.aclose()
        await node.gpu.stop()
        await node.nic.stop()
        await node.kubelet.stop()
        shutil.rmtree(directory, ignore_errors=True)


async def test_second_resource_preference_sees_the_first(node: Node) -> None:
    got = await node.kubelet.admit({GPU: 2, NIC: 2}, order=[GPU, NIC], pod=node.pod("gpu-first", gpu=2, nic=2))
    gpu_call, nic_call = node.seen[GPU][-1], node.seen[NIC][-1]
    assert gpu_call is not None and gpu_call.pod == "gpu-first" and gpu_call.partner_ids == frozenset()
    assert nic_call is not None and nic_call.pod == "gpu-first" and nic_call.partner_ids == set(got[GPU])

    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=node.pod("nic-first", gpu=1, nic=1))
    nic_call, gpu_call = node.seen[NIC][-1], node.seen[GPU][-1]
    assert nic_call is not None and nic_call.pod == "nic-first" and nic_call.partner_ids == frozenset()
    assert gpu_call is not None and gpu_call.pod == "nic-first" and gpu_call.partner_ids == set(got[NIC])
    assert node.registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "exact"}) == 4


async def test_single_resource_pods_are_not_paired(node: Node) -> None:
    await node.kubelet.admit({GPU: 1}, pod=node.pod("gpu-only", gpu=1))
    await node.kubelet.admit({NIC: 1}, pod=node.pod("nic-only", nic=1))
    nic_call = node.seen[NIC][-1]
    assert nic_call is not None and nic_call.pod == "nic-only" and nic_call.partner_ids == frozenset()


async def test_a_pod_the_watch_lags_on_is_found_from_the_kubelets_records(node: Node) -> None:
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=("ml", "not-watched-yet"))
    found = node.seen[NIC][-1]  # no spec: the one container newly holding a GPU and no VF
    assert found is not None and found.pod == "not-watched-yet" and found.partner_ids == set(got[GPU])
    assert node.seen[GPU][-1] is None  # its GPU call: nobody newly holds a VF, unknown
    assert node.registry.get_sample_value("gpu_node_agent_preference_fallbacks_total", {"reason": "no_new_holder"}) \
        == 0  # counted by the device plugin, not here
    assert node.registry.get_sample_value("gpu_node_agent_pod_resources_lookups_total", {"result": "unknown"}) == 1


async def test_device_pod_info_follows_the_kubelet(node: Node) -> None:
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, pod=node.pod("train", gpu=1, nic=1))
    await node.service.refresh()
    assert node.gauge("gpu_node_agent_pod_resources_up") == 1
    assert node.metric_rows() == {(GPU, got[GPU][0], "ml", "train", "main"), (NIC, got[NIC][0], "ml", "train", "main")}
    assert node.service.latest is not None and node.service.latest.free(GPU) == set(GPUS) - set(got[GPU])
    node.kubelet.end_pod("ml", "train")
    await node.service.refresh()
    assert node.metric_rows() == set()
    assert node.service.latest.free(GPU) == set(GPUS)


async def test_kubelet_restart_keeps_records_and_the_service_recovers(node: Node) -> None:
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, pod=node.pod("train", gpu=1, nic=1))
    await node.kubelet.stop()
    assert await node.service.refresh() is None
    assert node.gauge("gpu_node_agent_pod_resources_up") == 0
    await node.kubelet.start()  # what `restart` does after deleting the plugin sockets
    for _ in range(50):  # the channel reconnects within its short reconnect backoff
        if await node.service.refresh() is not None:
            break
        await asyncio.sleep(0.05)
    assert node.gauge("gpu_node_agent_pod_resources_up") == 1
    assert node.service.holders(got[GPU][0])[0].pod == "train"
