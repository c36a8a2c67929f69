"""Issue 28 over the real sockets (stand-in kubelet + PodResources v1, the agent's manager, NIC-only mode with a
stand-in for NVIDIA's plugin): pairing from the kubelet's records alone, bursts, late lookups, fallbacks.

- rule 1: without API access (no pod specs), a GPU-first 1 GPU + 1 NIC container gets a PIX VF whenever one
  under its GPU's switch is free, over churn in random resource order; several containers newly holding GPUs
  are paired with only when their GPUs share a switch;
- rule 3: 16 containers admitted back to back all pair, one `List` per preference call at most, within the
  agent's share of the kubelet's limit while another client reads PodResources too;
- rule 4: a lookup past its deadline still becomes the agent's reading;
- rule 5: without the partner, VFs under switches with free GPUs (or the candidates' GPUs); fallbacks counted;
- rule 1, ordering: a pod listed before another appeared has finished admission (joint mode, no API access);
- rule 6: right after an agent restart, before the ownership poll's first reading, a NIC-first container gets a
  VF under the one free GPU, not under GPUs held since before the restart; also (joint mode) when the poll's
  first reading came before the plugins registered again;
- rule 7: allocations counted by level, and none counted as a missed PIX.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from agent.ownership.service import DEFAULT_LOOKUP_S
from agent.placement.tree import switch_groups
from agent.simulate.kubelet import AdmissionError
from tests.ownership.rig import GPU, NIC, Node, Picks, node_factory, offered_only, pix

__all__ = ["node_factory"]  # the fixture


def switch_of(node: Node, gpu: str) -> frozenset[int] | None:
    return switch_groups(node.topology, True, frozenset([gpu]))


def vf_switch(node: Node, vf: str) -> frozenset[int] | None:
    return switch_groups(node.topology, False, frozenset([vf]))


async def churn(node: Node, containers: int, seed: int) -> dict[str, list[bool]]:
    """1 GPU + 1 NIC containers in random resource order, pods ending at random (at most 6 live). Per order,
    whether the rule held: GPU first, a PIX VF whenever one under its GPU's switch was free; NIC first, a VF under
    a switch with a free GPU whenever one was offered."""
    rng = random.Random(seed)  # noqa: S311
    live: list[tuple[str, str]] = []
    held: dict[str, list[bool]] = {"gpu-first": [], "nic-first": []}
    step = 0
    while len(held["gpu-first"]) + len(held["nic-first"]) < containers:
        step += 1
        node.now += 0.1
        if live and (len(live) >= 6 or rng.random() < 0.35):
            node.kubelet.end_pod(*live.pop(rng.randrange(len(live))))
            continue
        order = [GPU, NIC] if rng.random() < 0.5 else [NIC, GPU]
        free_gpus, free_vfs = node.free(GPU), node.free(NIC)
        key = node.pod(f"c{step}", {GPU: 1, NIC: 1})
        try:
            got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=order, pod=key)
        except AdmissionError:
            continue
        live.append(key)
        gpu, vf = got[GPU][0], got[NIC][0]
        if order[0] == GPU:
            held["gpu-first"].append(pix(node.topology, gpu, vf) or not any(pix(node.topology, gpu, v)
                                                                            for v in free_vfs))
        else:
            near_free = any(pix(node.topology, g, v) for g in free_gpus for v in free_vfs)
            held["nic-first"].append(any(pix(node.topology, g, vf) for g in free_gpus) or not near_free)
    return held


@pytest.mark.parametrize("profile", ["pcie-pairs", "dgx-h100"])
async def test_without_api_access_gpu_first_gets_a_pix_vf_whenever_one_is_free(node_factory, profile: str) -> None:
    node = await node_factory(serve_gpus=False, profile=profile, api=False)
    held = await churn(node, containers=40, seed=28)
    assert held["gpu-first"] and all(held["gpu-first"]), held
    assert held["nic-first"] and all(held["nic-first"]), held  # rule 5: near a free GPU, never a far default
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == len(held["gpu-first"])
    # a NIC-first container: nobody newly holds a GPU, so the agent cannot know; counted, never failed
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="no_new_holder") == len(held["nic-first"])
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="failed") == 0
    # rule 7: every GPU-first VF counted by its level against the container's GPU; NIC-first ones have none known
    paired = sum(node.sample("gpu_node_agent_allocations_total", resource=NIC, level=level)
                 for level in ("pix", "pxb", "phb", "node", "sys"))
    assert paired == len(held["gpu-first"])
    assert node.sample("gpu_node_agent_allocations_total", resource=NIC, level="none") == len(held["nic-first"])
    assert node.sample("gpu_node_agent_allocations_pix_missed_total", resource=NIC) == 0
    offered_only(node)


async def test_with_a_lagging_pod_watch_the_kubelets_records_still_pair(node_factory) -> None:
    node = await node_factory(serve_gpus=False, api=True)  # the watch is synced but has none of these pods
    held = await churn(node, containers=20, seed=3)
    node.specs.clear()
    assert held["gpu-first"] and all(held["gpu-first"]), held


async def test_several_new_gpu_holders_pair_only_under_one_switch(node_factory) -> None:
    node = await node_factory(serve_gpus=False, api=False)  # pcie-pairs: two GPUs per switch
    assert node.nvidia is not None
    picks = Picks()
    node.nvidia.rng = picks  # type: ignore[assignment]
    by_switch: dict[frozenset[int] | None, list[str]] = {}
    for gpu in node.gpu_ids():
        by_switch.setdefault(switch_of(node, gpu), []).append(gpu)
    (a, b), (c, _), (d, _), *_ = by_switch.values()

    picks.next = a  # a GPU-only pod, then a GPU-first pod on the same switch: either one, the same VFs
    await node.kubelet.admit({GPU: 1}, pod=node.pod("solo-1", {GPU: 1}))
    picks.next = b
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod("pair-1", {GPU: 1, NIC: 1}))
    assert pix(node.topology, b, got[NIC][0])
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="ambiguous") == 0

    picks.next = c  # ... on different switches: not paired, counted; the VF goes under one of the two switches
    await node.kubelet.admit({GPU: 1}, pod=node.pod("solo-2", {GPU: 1}))
    picks.next = d
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod("pair-2", {GPU: 1, NIC: 1}))
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="ambiguous") == 1
    assert vf_switch(node, got[NIC][0]) in (switch_of(node, c), switch_of(node, d))


async def test_a_gpu_only_pod_listed_before_a_nic_first_container_is_not_its_partner(node_factory) -> None:
    """Joint mode without API access: the GPU-only pod newly holds a GPU at the NIC-first container's NIC call,
    but it was listed before that pod appeared, so its admission is over (the kubelet admits one pod at a time)."""
    node = await node_factory(serve_gpus=True, api=False)
    (solo_gpu,) = (await node.kubelet.admit({GPU: 1}, pod=node.pod("solo", {GPU: 1})))[GPU]
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=node.pod("nic-first", {GPU: 1, NIC: 1}))
    # the NIC call knew nothing (counted), the GPU call paired exactly with the NIC
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="no_new_holder") == 2  # + solo's call
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == 1
    assert pix(node.topology, got[GPU][0], got[NIC][0]) and got[GPU] != [solo_gpu]


async def test_a_nic_first_container_gets_a_vf_under_the_one_free_gpu(node_factory) -> None:
    node = await node_factory(serve_gpus=False, api=False, profile="dgx-h100")
    assert node.nvidia is not None
    picks = Picks()
    node.nvidia.rng = picks  # type: ignore[assignment]
    gpus = node.gpu_ids()
    for i, gpu in enumerate(gpus[:-1]):  # every GPU but the highest UUID is held by a GPU-only pod
        picks.next = gpu
        await node.kubelet.admit({GPU: 1}, pod=node.pod(f"solo-{i}", {GPU: 1}))
    assert node.service is not None
    node.service.listings.settle = 0.0  # a poll has seen them, long enough ago: not new holders
    await node.service.refresh()
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=node.pod("nic-first", {GPU: 1, NIC: 1}))
    assert got[GPU] == [gpus[-1]] and pix(node.topology, gpus[-1], got[NIC][0])
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="no_new_holder") == 1


@pytest.mark.parametrize("held_by", ["gpu-only", "gpu-and-nic"])
@pytest.mark.parametrize("serve_gpus", [False, True], ids=["nic-only", "joint"])
async def test_right_after_a_restart_a_nic_first_container_goes_under_a_free_gpu(node_factory, serve_gpus: bool,
                                                                                 held_by: str) -> None:
    """Rule 6: pods admitted before the restart hold every GPU but one; the first preference call after it comes
    before the ownership poll's first reading. Their GPUs must not look free, nor their holders new."""
    node = await node_factory(serve_gpus=serve_gpus, api=False, profile="dgx-h100")
    picks = Picks()
    if node.nvidia is not None:
        node.nvidia.rng = picks  # type: ignore[assignment]
    requests = {GPU: 1} if held_by == "gpu-only" else {GPU: 1, NIC: 1}
    for i, gpu in enumerate(node.gpu_ids()[:-1]):
        picks.next = gpu  # NVIDIA's plugin takes them in order; in joint mode the agent picks
        await node.kubelet.admit(requests, order=[GPU, NIC][:len(requests)], pod=node.pod(f"old-{i}", requests))
    (last,) = node.free(GPU)
    await node.stop_agent()
    await node.start_agent(first_poll=False)
    assert node.service is not None and node.service.latest is None
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=node.pod("nic-first", {GPU: 1, NIC: 1}))
    assert got[GPU] == [last] and pix(node.topology, last, got[NIC][0]), got
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="no_new_holder") == 1
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="ambiguous") == 0
    assert node.service.read_fully
    # the next GPU-first container is paired exactly again (the first reading was the baseline, not a blind spot)
    node.kubelet.end_pod("ml", "old-0")
    (freed,) = node.free(GPU)
    picks.next = freed
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod("gpu-first", {GPU: 1, NIC: 1}))
    assert got[GPU] == [freed] and pix(node.topology, freed, got[NIC][0]), got


@pytest.mark.parametrize("api", [True, False], ids=["pod-specs", "no-api"])
async def test_after_a_restart_whose_first_poll_beat_the_registration_a_nic_first_container_takes_the_free_pair(
        node_factory, api: bool) -> None:
    """Issue 37 item 7 (joint mode): the ownership poll's first reading after a restart comes before the device
    plugins register again, so the kubelet's allocatable has none of the agent's devices. Pods from before the
    restart hold every GPU but one; the NIC-first container must take a VF under that GPU's switch."""
    node = await node_factory(serve_gpus=True, api=api, profile="dgx-h100")
    for i in range(len(node.gpu_ids()) - 1):
        requests = {GPU: 1, NIC: 1} if i % 2 else {GPU: 1}
        await node.kubelet.admit(requests, order=[GPU, NIC][:len(requests)], pod=node.pod(f"old-{i}", requests))
    (last,) = node.free(GPU)
    for _ in range(2):
        await node.stop_agent()
        await node.start_agent(poll_first=True)
    assert node.service is not None and node.service.read_fully
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=node.pod("nic-first", {GPU: 1, NIC: 1}))
    assert got[GPU] == [last] and pix(node.topology, last, got[NIC][0]), got
    offered_only(node)


async def test_a_burst_of_sixteen_containers_all_pair_within_the_rate_limit(node_factory) -> None:
    node = await node_factory(serve_gpus=False, api=False, profile="dgx-h100", real_clock=True,
                              lookup_timeout=max(DEFAULT_LOOKUP_S, 0.2))  # the deadline's sizing is rule 4's
    server = node.kubelet.pod_resources
    assert server is not None
    before = dict(server.calls)
    stop = asyncio.Event()

    async def dcgm_exporter() -> None:  # another client of the kubelet's one bucket: 20 Lists a second
        from agent.host.podresources.client import KubeletPodResources
        other = KubeletPodResources(server.socket_path)
        try:
            while not stop.is_set():
                await other.list(1.0, patient=True)
                await asyncio.sleep(0.05)
        finally:
            await other.aclose()

    neighbour = asyncio.create_task(dcgm_exporter())
    live: list[tuple[str, str]] = []
    started = time.monotonic()
    pix_held = []
    try:
        for i in range(16):
            if len(live) >= 6:
                node.kubelet.end_pod(*live.pop(0))
            free_vfs = node.free(NIC)
            got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod(f"gang-{i}",
                                                                                              {GPU: 1, NIC: 1}))
            live.append(("ml", f"gang-{i}"))
            gpu = got[GPU][0]
            pix_held.append(pix(node.topology, gpu, got[NIC][0])
                            or not any(pix(node.topology, gpu, v) for v in free_vfs))
    finally:
        stop.set()
        await neighbour
    elapsed = time.monotonic() - started
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == 16
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="failed") == 0
    assert all(pix_held), pix_held
    ours = server.calls.get("List", 0) - before.get("List", 0)
    assert ours <= 16 + 20 * elapsed + 2  # one List per preference call (+ the neighbour's, + a poll)


async def test_a_late_lookup_still_teaches_the_next_call(node_factory) -> None:
    node = await node_factory(serve_gpus=False, api=False, lookup_timeout=0.02)
    server, service = node.kubelet.pod_resources, node.service
    assert server is not None and service is not None
    server.hold = lambda: asyncio.sleep(0.15)
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod("slow", {GPU: 1, NIC: 1}))
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="timeout") == 1
    server.hold = None
    for _ in range(50):  # no poll runs here: only the late reply can bring the pod into the agent's reading
        if service.latest is not None and any(c.pod == "slow" for c in service.latest.containers):
            break
        await asyncio.sleep(0.02)
    assert service.latest is not None
    assert {i for c in service.latest.containers if c.pod == "slow" for i in c.of(GPU)} == set(got[GPU])
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=node.pod("next", {GPU: 1, NIC: 1}))
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == 1
