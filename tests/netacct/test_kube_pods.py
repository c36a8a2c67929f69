"""Pods from the Kubernetes API as netacct's pod source: `KubePodSource` on the real lightkube port against the
HTTP API double (and on the simulated cluster), and a netacct service fed by it. Backoffs run on a fake clock;
`until` only guards against hangs, nothing asserts on wall-clock time."""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.config.netacct import NetacctConfig
from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import PodView
from agent.kube.simulated import demo_cluster
from agent.netacct.service import NetacctService
from agent.pods.kube import KubePodSource
from agent.pods.model import make_pod
from tests.fakes import fixtures
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.netacct.fakes import FakeHost

NODE = fixtures.NODE  # the node the shared API double serves


@pytest.fixture
async def api(api: ApiServerDouble):
    """The shared API double, plus: only requests the agent's RBAC allows, all scoped to this node."""
    yield api
    assert_only_allowed(api.requests, NODE, "unused")
    assert api.pod_requests() and all(  # never a cluster-wide list or watch
        r.query.get("fieldSelector") == f"spec.nodeName={NODE}" for r in api.pod_requests())


@pytest.fixture
async def port(api: ApiServerDouble, tmp_path: Path):
    cluster = connect(NODE, ApiRequestCounter(CollectorRegistry()), str(write_kubeconfig(tmp_path / "kc", api.url)),
                      timeout=0.5)
    yield cluster
    await cluster.aclose()


def source_on(port: LightkubeCluster, clock: FakeClock) -> KubePodSource:
    return KubePodSource(port, clock=clock, rng=random.Random(5))  # noqa: S311 - jitter


async def test_only_pods_with_their_own_ips_are_published(api: ApiServerDouble, port, clock, caplog):
    api.add_pod("team", "trainer", ips=("10.1.0.5", "fd00::5"))
    api.add_pod("kube-system", "kube-proxy-x", owner="DaemonSet", ips=("192.168.0.7",), host_network=True)
    api.add_pod("team", "pending")  # no IP yet
    api.add_pod("team", "finished", phase="Succeeded", ips=("10.1.0.9",))  # its IP is back in the pool
    api.add_pod("team", "broken", ips=("not-an-ip",))
    api.add_pod("team", "elsewhere", node="other-node", ips=("10.2.0.1",))
    source = source_on(port, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        await until(lambda: source.snapshot()[1] is not None, "the first list")
        assert source.snapshot()[1] == (make_pod("team", "trainer", ["10.1.0.5", "fd00::5"], "uid-team-trainer"),)
        assert caplog.text.count("skipping pod team/broken") == 1

        api.update_pod("team", "pending", {"status": {"podIPs": [{"ip": "10.1.0.6"}]}})  # the kubelet reports it
        await until(lambda: len(source.snapshot()[1] or ()) == 2, "the pod with its new IP")
        api.delete_pod("team", "trainer")
        api.update_pod("team", "broken", {"metadata": {"labels": {"a": "b"}}})  # warned once, not per change
        await until(lambda: source.snapshot()[1] == (make_pod("team", "pending", ["10.1.0.6"], "uid-team-pending"),),
                    "the delete")
        assert caplog.text.count("skipping pod team/broken") == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_the_set_stays_unknown_until_the_first_list_succeeds(api: ApiServerDouble, port, clock):
    api.add_pod("team", "trainer", ips=("10.1.0.5",))
    api.fail("GET", r"/api/v1/pods$", 503, times=2)
    source = source_on(port, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        for _ in range(2):
            await until(lambda: clock.next_deadline() is not None, "a backoff wait")
            assert source.snapshot() == (0, None)  # unknown: the engine keeps the members it finds
            await clock.advance(clock.next_deadline() - clock.now())  # type: ignore[operator]
        await until(lambda: source.snapshot()[1] is not None, "the first list")
        assert source.snapshot() == (1, (make_pod("team", "trainer", ["10.1.0.5"], "uid-team-trainer"),))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_netacct_service_fed_by_the_pod_watch_accounts_the_nodes_pods(api: ApiServerDouble, port, clock):
    api.add_pod("team", "trainer", ips=("10.1.0.5",))
    api.fail("GET", r"/api/v1/pods$", 503)  # the API server is not there yet when the agent starts
    host = FakeHost()
    service = NetacctService(NetacctConfig(enabled=True, ipv6=False), CollectorRegistry(), source_on(port, clock),
                             host=host, settle_seconds=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    try:
        await asyncio.wait_for(service.synced.wait(), 5)  # synced with pods unknown: nothing added, nothing lost
        assert not any("10.1.0.5" in payload for payload in host.ipset_payloads)
        await until(lambda: clock.next_deadline() is not None, "a backoff wait")
        await clock.advance(clock.next_deadline() - clock.now())  # type: ignore[operator]
        await until(lambda: any("add gna-rx-inet4 10.1.0.5" in p for p in host.ipset_payloads), "the pod's IP")

        api.add_pod("team", "server", ips=("10.1.0.8",))
        api.delete_pod("team", "trainer")
        await until(lambda: "add gna-rx-inet4 10.1.0.8" in host.ipset_payloads[-1]
                    and "10.1.0.5" not in host.ipset_payloads[-1], "the new pod set")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        service.close()


async def test_the_simulated_cluster_feeds_the_same_source(caplog):
    caplog.set_level(logging.INFO)
    cluster = demo_cluster("sim-node")
    source = KubePodSource(cluster)
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        await until(lambda: source.snapshot()[1] is not None, "the first list")
        trainer = make_pod("default", "training-job-0", ["10.244.0.10", "fd00:10:244::a"])
        assert source.snapshot()[1] == (trainer,)  # the host-network DaemonSet pod is the node's traffic
        await cluster.evict_pod("default", "training-job-0")
        await until(lambda: source.snapshot()[1] == (), "the eviction")
        cluster.add_pod(PodView("default", "training-job-1", ("Job",), ips=("10.244.0.11",)))
        await until(lambda: len(source.snapshot()[1] or ()) == 1, "a new pod")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
    assert "following the pods of node sim-node" in caplog.text



async def test_a_bug_in_the_watch_is_logged_and_the_watch_restarted(caplog):
    clock = FakeClock()
    cluster = demo_cluster("sim-node")
    source = KubePodSource(cluster, clock=clock)
    calls = {"n": 0}
    listing = cluster.list_node_pods

    async def flaky():  # not an API error: a bug, which must not silently end the pod feed
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return await listing()

    cluster.list_node_pods = flaky  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(source.run(stop))
    try:
        await until(lambda: clock.next_deadline() is not None, "the restart delay")
        assert "pod watch failed unexpectedly" in caplog.text and source.snapshot()[1] is None
        await clock.advance(clock.next_deadline() - clock.now())  # type: ignore[operator]
        await until(lambda: source.snapshot()[1] is not None, "the restarted watch")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
