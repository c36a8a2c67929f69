"""Placement follows the data path on every GPU-NIC shape (issue 43), end to end over unix sockets.

The stand-in kubelet admits 1 GPU + 1 NIC containers in both resource orders on the Grace and ConnectX-8 profiles
(Data Direct, C2C, inline) and on the DGX H100; every container gets a VF of its GPU's `gpu_direct_group`
whenever a free GPU and a free VF of one group existed when its admission started (joint mode), or whenever a
VF of the group of the GPU NVIDIA's stand-in chose was free (NIC-only mode, GPUs named by UUID or by PCI bus id).
"""

from __future__ import annotations

import random

import pytest

from agent.simulate.kubelet import AdmissionError
from agent.topology.model import Topology
from tests.ownership.rig import GPU, NIC, Node, node_factory, offered_only

__all__ = ["node_factory"]  # the fixture

PROFILES = ["gb300-cx8", "gb200-cx7", "hgx-b300-cx8", "dgx-h100"]


def group_of(topology: Topology, device_id: str) -> str:
    gpu = topology.gpu_of(device_id)
    if gpu is not None:
        return gpu.gpu_direct_group
    found = topology.find(device_id)
    return getattr(found, "gpu_direct_group", "") if found is not None else ""


def same_group(topology: Topology, gpu: str, vf: str) -> bool:
    group = group_of(topology, gpu)
    return bool(group) and group == group_of(topology, vf)


async def churn(node: Node, steps: int, seed: int) -> dict[str, list[bool]]:
    """1 GPU + 1 NIC pods admitted and ended at random; per first resource, whether the promise held."""
    rng = random.Random(seed)  # noqa: S311
    live: list[tuple[str, str]] = []
    held: dict[str, list[bool]] = {"gpu-first": [], "nic-first": []}
    for step in range(steps):
        node.now += 0.1
        if live and (len(live) >= 3 or rng.random() < 0.3):
            node.kubelet.end_pod(*live.pop(rng.randrange(len(live))))
            continue
        requests = {GPU: 1, NIC: 1}
        order = [GPU, NIC] if rng.random() < 0.5 else [NIC, GPU]
        free_gpus, free_vfs = node.free(GPU), node.free(NIC)
        feasible = any(same_group(node.topology, g, v) for g in free_gpus for v in free_vfs)
        key = node.pod(f"p{step}", requests)
        try:
            got = await node.kubelet.admit(requests, order=order, pod=key)
        except AdmissionError:
            continue
        live.append(key)
        gpu, vf = got[GPU][0], got[NIC][0]
        first = "gpu-first" if order[0] == GPU else "nic-first"
        if node.serve_gpus:
            held[first].append(same_group(node.topology, gpu, vf) or not feasible)
        elif first == "gpu-first":  # NIC-only: VFs of the group of the GPU the other plugin chose
            held[first].append(same_group(node.topology, gpu, vf)
                               or not any(same_group(node.topology, gpu, v) for v in free_vfs))
    return held


@pytest.mark.parametrize("profile", PROFILES)
async def test_joint_mode_every_container_gets_its_gpus_group_nic(node_factory, profile: str) -> None:
    node = await node_factory(serve_gpus=True, profile=profile)
    assert all(g.gpu_direct_group for g in node.topology.gpus)
    held = await churn(node, steps=60, seed=43)
    assert len(held["gpu-first"]) >= 5 and len(held["nic-first"]) >= 5, held
    assert all(held["gpu-first"]), held
    assert all(held["nic-first"]), held
    offered_only(node)


@pytest.mark.parametrize("by_bus_id", [False, True], ids=["uuid", "bus-id"])
@pytest.mark.parametrize("profile", ["gb300-cx8", "gb200-cx7"])
async def test_nic_only_mode_gets_the_group_of_the_gpu_the_other_plugin_chose(node_factory, profile: str,
                                                                              by_bus_id: bool) -> None:
    node = await node_factory(serve_gpus=False, profile=profile, gpus_by_bus_id=by_bus_id)
    held = await churn(node, steps=60, seed=7)
    assert len(held["gpu-first"]) >= 5 and all(held["gpu-first"]), held
    offered_only(node)
