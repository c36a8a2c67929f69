"""Issue 28 rule 2 over the real sockets and the real pod watch: the agent's own-node pod watch (lightkube against
the API double) is synced but lags, so a pod created at the instant the kubelet admits it has no spec yet.

What main does then: the spec lookup finds nobody and the kubelet's records alone decide (rule 1), so the
container still pairs; no spec is fetched for it. Where rule 1 alone would see two candidates (a GPU-only pod and
a GPU-first container admitted back to back, GPUs under different switches), the spec the watch already has for
one of them rules it out.
"""

from __future__ import annotations

import asyncio
import random

from agent.kube.cluster import LightkubeCluster
from agent.kube.podwatch import NodePodWatch
from agent.placement.tree import switch_groups
from tests.fakes.apiserver import ApiServerDouble
from tests.ownership.rig import GPU, NIC, Picks, api_pod, cluster, node_factory, offered_only, pix, until, watch

__all__ = ["cluster", "node_factory", "watch"]  # the fixtures


async def test_a_pod_the_watch_has_not_delivered_pairs_from_the_kubelets_records(
        node_factory, api: ApiServerDouble, cluster: LightkubeCluster, watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, profile="dgx-h100", pod_lookup=cluster,
                              watched=lambda: watch.pods if watch.synced else None)
    api.pod_watch_gate = asyncio.Event()  # from now on the watch lags
    rng = random.Random(2)  # noqa: S311
    live: list[tuple[str, str]] = []
    gpu_first = 0
    for i in range(12):
        node.now += 0.1
        if len(live) >= 5:
            node.kubelet.end_pod(*live.pop(rng.randrange(len(live))))
        order = [GPU, NIC] if rng.random() < 0.5 else [NIC, GPU]
        free_vfs = node.free(NIC)
        key = api_pod(api, f"lag-{i}", {GPU: 1, NIC: 1})  # created as the kubelet admits it
        got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=order, pod=key)
        assert key not in watch.pods  # the watch has not delivered it: no spec at the preference call
        live.append(key)
        if order[0] == GPU:
            gpu_first += 1
            gpu = got[GPU][0]
            assert pix(node.topology, gpu, got[NIC][0]) or not any(pix(node.topology, gpu, v) for v in free_vfs)
    assert gpu_first
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == gpu_first
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="no_new_holder") == 12 - gpu_first
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="ambiguous") == 0
    assert api.namespaced_pod_requests() == []  # one new holder: no spec was fetched
    api.pod_watch_gate.set()
    await until(lambda: all(k in watch.pods for k in live))
    offered_only(node)


async def test_the_watchs_spec_rules_out_a_gpu_only_pod_rule_1_would_count(
        node_factory, api: ApiServerDouble, cluster: LightkubeCluster, watch: NodePodWatch) -> None:
    node = await node_factory(serve_gpus=False, pod_lookup=cluster,
                              watched=lambda: watch.pods if watch.synced else None)
    assert node.nvidia is not None
    picks = Picks()
    node.nvidia.rng = picks  # type: ignore[assignment]
    by_switch: dict[frozenset[int] | None, list[str]] = {}
    for gpu in node.gpu_ids():
        by_switch.setdefault(switch_groups(node.topology, True, frozenset([gpu])), []).append(gpu)
    (a, _), (b, _), *_ = by_switch.values()

    picks.next = a  # a GPU-only pod the watch has delivered ...
    solo = api_pod(api, "solo", {GPU: 1})
    await until(lambda: solo in watch.pods)
    await node.kubelet.admit({GPU: 1}, pod=solo)
    api.pod_watch_gate = asyncio.Event()
    picks.next = b  # ... then a GPU-first pod it has not, on another switch: two new GPU holders in the records
    pair = api_pod(api, "pair", {GPU: 1, NIC: 1})
    got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[GPU, NIC], pod=pair)
    assert pair not in watch.pods
    assert got[GPU] == [b] and pix(node.topology, b, got[NIC][0]), got
    assert node.sample("gpu_node_agent_preference_fallbacks_total", reason="ambiguous") == 0
    assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") == 1
    assert api.namespaced_pod_requests() == []  # the watch's spec was enough
