"""Exact GPU-NIC pairing from the kubelet's facts, end to end over unix sockets.

The stand-in kubelet admits pods resource by resource in a random order and serves PodResources v1; the agent's
device-plugin manager serves the devices and, in every preference call, asks the ownership service (real gRPC
client, pod specs as the own-node pod watch gives them) which devices of the other kind the container already
holds. Checked on churn with 20 % single-resource pods and an agent restart in the middle:
- joint mode (the agent serves GPUs and VFs): every GPU+NIC container is PIX whenever a PIX pair was free when
  its admission started; also with two restarts each answered before the ownership poll's first reading (the
  first lookup takes the full reading itself), with and without pod specs, and with two restarts whose poll's
  first reading came before the plugins registered again (the kubelet had none of their devices allocatable);
- NIC-only mode (a stand-in for NVIDIA's plugin serves GPUs by UUID and picks them itself): every container
  whose GPU came first gets a PIX VF whenever one under its GPU's switch was free;
- no preference ever names a device the kubelet did not offer;
- with the PodResources API away, slow or answering garbage the agent keeps serving (its own policy).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from agent.simulate.kubelet import AdmissionError
from tests.ownership.rig import GPU, NIC, Node, node_factory, offered_only, pix

__all__ = ["node_factory"]  # the fixture


async def churn(node: Node, steps: int, seed: int, restarts: tuple[float, ...] = (0.5,), *,
                first_poll: bool = True, poll_first: bool = False) -> dict[str, list[bool]]:
    """Admit and end pods; per kind of GPU+NIC admission ('gpu-first'/'nic-first'), whether the promise held.
    The agent restarts at each of `restarts` (fractions of `steps`); the kubelet keeps its records."""
    rng = random.Random(seed)  # noqa: S311
    live: list[tuple[str, str]] = []
    held: dict[str, list[bool]] = {"gpu-first": [], "nic-first": []}
    restart_steps = {int(steps * at) for at in restarts}
    for step in range(steps):
        node.now += 0.1
        if step in restart_steps:
            await node.stop_agent()
            await node.start_agent(first_poll=first_poll, poll_first=poll_first)
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


async def test_joint_mode_every_pair_is_pix_when_one_was_free(node_factory) -> None:
    node = await node_factory(serve_gpus=True)
    held = await churn(node, steps=80, seed=11)
    assert held["gpu-first"] and held["nic-first"]
    assert all(held["gpu-first"]), held
    assert all(held["nic-first"]), held
    offered_only(node)


@pytest.mark.parametrize("api", [True, False], ids=["pod-specs", "no-api"])
async def test_joint_mode_two_restarts_before_the_first_poll_every_pair_is_pix_when_one_was_free(
        node_factory, api: bool) -> None:
    node = await node_factory(serve_gpus=True, api=api)
    held = await churn(node, steps=90, seed=28, restarts=(1 / 3, 2 / 3), first_poll=False)
    assert held["gpu-first"] and held["nic-first"]
    assert all(held["gpu-first"]), held
    assert all(held["nic-first"]), held
    assert node.service is not None and node.service.read_fully  # the first lookup took the full reading
    offered_only(node)


@pytest.mark.parametrize("api", [True, False], ids=["pod-specs", "no-api"])
async def test_joint_mode_two_restarts_with_the_first_poll_before_registration_every_pair_is_pix(
        node_factory, api: bool) -> None:
    """Issue 37 item 7: the ownership poll's first reading after each restart comes before the device plugins
    register again, when the kubelet has none of the agent's devices as allocatable (a disconnected plugin's
    devices are unhealthy until its successor's first ListAndWatch). 36 GPU+NIC containers, every one PIX
    whenever a free GPU and a free VF shared a switch."""
    node = await node_factory(serve_gpus=True, api=api, profile="dgx-h100")
    held = await churn(node, steps=100, seed=30, restarts=(1 / 3, 2 / 3), poll_first=True)
    pairs = held["gpu-first"] + held["nic-first"]
    assert len(pairs) >= 36 and held["nic-first"], held
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
