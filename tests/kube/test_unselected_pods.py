"""Pod LISTs through a server or proxy that ignores the field selector: pods of other nodes in the answer are
skipped and counted (`gpu_node_agent_apiserver_foreign_pods_total`), never believed; and a 20,000-pod answer is
decoded without holding the event loop (a probe task's wake-ups stay on time)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.kube.conftest import NODE

FOREIGN = "gpu_node_agent_apiserver_foreign_pods_total"
BIG = 20_000
PROBE_S = 0.005
LOOP_BOUND_S = 0.05  # the bound on any one hold of the loop
ROUNDS = 3


def _ignore_field_selectors(api: ApiServerDouble) -> None:
    api._selects = lambda selector, obj: True  # type: ignore[method-assign]  # a proxy dropping fieldSelector


def _foreign(port: LightkubeCluster) -> float:
    return port.registry.get_sample_value(FOREIGN, {"request": "find_node_pod"}) or 0.0  # type: ignore[attr-defined]


async def test_a_pod_on_another_node_is_not_believed_when_the_selector_is_ignored(port, api) -> None:
    _ignore_field_selectors(api)
    api.add_pod("team", "train-0", node="other-node")
    assert await port.find_node_pod("team", "train-0") is None
    assert _foreign(port) == 1
    api.add_pod("team", "train-1")  # on this node, beside pods of this and other nodes in the answer
    pod = await port.find_node_pod("team", "train-1")
    assert pod is not None and pod.key == ("team", "train-1")


async def test_the_node_pod_list_skips_pods_of_other_nodes(port, api) -> None:
    _ignore_field_selectors(api)
    api.add_pod("team", "mine-0")
    api.add_pod("team", "theirs-0", node="other-node")
    api.add_pod("kube-system", "theirs-1", node="other-node")
    api.add_pod("kube-system", "mine-1")
    listed = await port.list_node_pods()
    assert sorted(p.key for p in listed.pods) == [("kube-system", "mine-1"), ("team", "mine-0")]
    assert listed.resource_version
    assert port.registry.get_sample_value(FOREIGN, {"request": "list_node_pods"}) == 2  # type: ignore[attr-defined]
    assert sorted(p.key for p in await port.list_pods()) == [("kube-system", "mine-1"), ("team", "mine-0")]


async def _worst_hold(work: asyncio.Future[Any]) -> float:
    """The longest time the loop was held while `work` ran: how late a task asking for 5 ms sleeps woke up."""
    worst = 0.0
    while not work.done():
        started = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        worst = max(worst, time.perf_counter() - started - PROBE_S)
    return worst


async def test_a_20000_pod_answer_is_decoded_without_holding_the_loop(tmp_path: Path) -> None:
    double = subprocess.Popen([sys.executable, "-m", "tests.fakes.apiserver_proc", "--node", NODE, "--pods",
                               str(BIG), "--own", "train-0", "--ignore-field-selectors"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert double.stdout is not None
        url = (await asyncio.to_thread(double.stdout.readline)).strip()
        registry = CollectorRegistry()
        port = connect(NODE, ApiRequestCounter(registry), str(write_kubeconfig(tmp_path / "kc", url)), timeout=30)
        held, held_list = [], []
        try:
            await port.find_node_pod("team", "absent")  # connection set up and code paths warm, not measured
            for _ in range(ROUNDS):
                find = asyncio.ensure_future(port.find_node_pod("team", "train-0"))
                held.append(await _worst_hold(find))
                pod = await find
                assert pod is not None and pod.key == ("team", "train-0")
                listing = asyncio.ensure_future(port.list_node_pods())
                held_list.append(await _worst_hold(listing))
                pods = (await listing).pods
                assert len(pods) == BIG // 10 + 1  # every tenth is on this node, and train-0
            assert registry.get_sample_value(FOREIGN, {"request": "list_node_pods"}) == ROUNDS * (BIG - BIG // 10)
        finally:
            await port.aclose()
    finally:
        assert double.stdin is not None
        double.stdin.close()
        double.wait(10)
    # a hold of the loop by the decode shows in every round; the scheduler of a shared machine does not
    print(f"worst loop hold, best of {ROUNDS}: find_node_pod {min(held) * 1e3:.1f} ms, "
          f"list_node_pods {min(held_list) * 1e3:.1f} ms (all: {held}, {held_list})")
    assert min(held) < LOOP_BOUND_S and min(held_list) < LOOP_BOUND_S, (held, held_list)
