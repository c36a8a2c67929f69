"""Issue 28 rule 2's last case over the real sockets, the real pod watch and the API double: NIC-only mode, a
GPU-only pod and a GPU-first pod first appear in the same PodResources listing, the watch (gated) has delivered
neither spec, and their GPUs sit under different switches. The kubelet's records alone cannot tell them apart;
the agent fetches both specs (one namespaced LIST each, bounded to its node) within the lookup's deadline.
"""

from __future__ import annotations

import asyncio

from agent.kube.cluster import LightkubeCluster
from agent.kube.podwatch import NodePodWatch
from agent.placement.tree import switch_groups
from tests.fakes import fixtures
from tests.fakes.apiserver import ApiServerDouble
from tests.ownership.rig import GPU, NIC, Node, Picks, api_pod, cluster, node_factory, pix, until, watch

__all__ = ["cluster", "node_factory", "watch"]  # the fixtures

FETCHES = "gpu_node_agent_pod_spec_fetches_total"
FALLBACKS = "gpu_node_agent_preference_fallbacks_total"


def by_switch(node: Node) -> list[list[str]]:
    groups: dict[frozenset[int] | None, list[str]] = {}
    for gpu in node.gpu_ids():
        groups.setdefault(switch_groups(node.topology, True, frozenset([gpu])), []).append(gpu)
    return list(groups.values())


def under_either(node: Node, vf: str, *gpus: str) -> bool:
    """The VF sits under the switch of one of `gpus` (the fallback aims at the candidates' GPUs)."""
    return switch_groups(node.topology, False, frozenset([vf])) in {
        switch_groups(node.topology, True, frozenset([g])) for g in gpus}


async def two_pods_unseen(node: Node, api: ApiServerDouble, solo_gpu: str, pair_gpu: str) -> dict[str, list[str]]:
    """A GPU-only pod, then a GPU-first GPU+NIC pod, both created as the kubelet admits them with the watch
    gated, no List between them: both are new GPU holders in the NIC call's listing."""
    assert node.nvidia is not None
    picks = Picks()
    node.nvidia.rng = picks  # type: ignore[assignment]
    api.pod_watch_gate = asyncio.Event()
    picks.next = solo_gpu
    await node.kubelet.admit({GPU: 1}, pod=api_pod(api, "solo", {GPU: 1}))
    picks.next = pair_gpu
    return await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=api_pod(api, "pair", {GPU: 1, NIC: 1}))


def lookups(api: ApiServerDouble) -> set[tuple[str, frozenset[str]]]:
    return {(r.path, frozenset(r.query.get("fieldSelector", "").split(","))) for r in api.namespaced_pod_requests()}


def expected_lookups(*names: str) -> set[tuple[str, frozenset[str]]]:
    return {("/api/v1/namespaces/ml/pods", frozenset({f"metadata.name={n}", f"spec.nodeName={fixtures.NODE}"}))
            for n in names}


async def test_two_unseen_pods_under_different_switches_pair_pix_by_fetching_their_specs(
        node_factory, api: ApiServerDouble, cluster: LightkubeCluster, watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, pod_lookup=cluster, watched=lambda: watch.pods)
    (a, *_), (b, *_), *_ = by_switch(node)
    got = await two_pods_unseen(node, api, a, b)
    assert ("ml", "pair") not in watch.pods and ("ml", "solo") not in watch.pods
    assert got[GPU] == [b] and pix(node.topology, b, got[NIC][0]), got
    assert node.sample(FALLBACKS, reason="ambiguous") == 0
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == 1
    assert node.sample("gpu_node_agent_allocations_total", resource=NIC, level="pix") == 1
    assert node.sample(FETCHES, outcome="found") == 2
    assert len(api.namespaced_pod_requests()) == 2 and lookups(api) == expected_lookups("solo", "pair")
    assert len(api.pod_requests(watches=False)) == 1  # the watch's first list: no node-wide list for a spec

    # the watch delivers them later: the fetched copies give way to the watch's
    assert node.service is not None and node.service.spec_fetcher is not None
    assert set(node.service.spec_fetcher.fetched) == {("ml", "solo"), ("ml", "pair")}
    assert api.pod_watch_gate is not None
    api.pod_watch_gate.set()
    await until(lambda: ("ml", "pair") in watch.pods and ("ml", "solo") in watch.pods)
    assert node.service.pod("ml", "pair") == watch.pods[("ml", "pair")]
    await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=api_pod(api, "next", {GPU: 1, NIC: 1}))
    assert node.service.spec_fetcher.fetched == {}
    assert len(api.namespaced_pod_requests()) == 2  # one new holder: nothing fetched


async def test_under_one_switch_nothing_is_fetched(node_factory, api: ApiServerDouble, cluster: LightkubeCluster,
                                                   watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, pod_lookup=cluster, watched=lambda: watch.pods)
    (a, b, *_), *_ = by_switch(node)  # pcie-pairs: two GPUs per switch
    got = await two_pods_unseen(node, api, a, b)
    assert pix(node.topology, b, got[NIC][0])
    assert api.namespaced_pod_requests() == []  # either candidate gives the same VFs
    assert node.sample(FALLBACKS, reason="ambiguous") == 0


async def test_a_slow_api_server_falls_back_at_the_deadline_and_its_late_answer_is_kept(
        node_factory, api: ApiServerDouble, cluster: LightkubeCluster, watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, pod_lookup=cluster, watched=lambda: watch.pods, lookup_timeout=0.3,
                              fetch_late_s=60.0)
    (a, *_), (b, *_), *_ = by_switch(node)
    api.pod_lookup_gate = asyncio.Event()  # the API server holds the answers
    got = await two_pods_unseen(node, api, a, b)
    # the preference call was answered while the API server still held both answers: it fell back, counted
    assert not api.pod_lookup_gate.is_set() and len(api.namespaced_pod_requests()) == 2
    assert node.sample(FALLBACKS, reason="ambiguous") == 1
    assert under_either(node, got[NIC][0], a, b)
    assert sum(node.sample(FETCHES, outcome=o) for o in ("found", "late", "not_found", "error")) == 0
    api.pod_lookup_gate.set()
    await until(lambda: node.sample(FETCHES, outcome="late") == 2)
    assert node.service is not None
    assert node.service.pod("ml", "pair") is not None  # kept for the next call, before the watch has it
    assert ("ml", "pair") not in watch.pods


async def test_an_erroring_api_server_falls_back_and_counts_it(node_factory, api: ApiServerDouble,
                                                                cluster: LightkubeCluster, watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, pod_lookup=cluster, watched=lambda: watch.pods)
    (a, *_), (b, *_), *_ = by_switch(node)
    api.fail("GET", r"^/api/v1/namespaces/ml/pods$", 503, times=2)
    got = await two_pods_unseen(node, api, a, b)
    assert node.sample(FETCHES, outcome="error") == 2 and node.sample(FETCHES, outcome="found") == 0
    assert node.sample(FALLBACKS, reason="ambiguous") == 1
    assert under_either(node, got[NIC][0], a, b)
    assert lookups(api) == expected_lookups("solo", "pair")
