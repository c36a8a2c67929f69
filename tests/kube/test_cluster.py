"""The lightkube cluster port against the HTTP double: each request shape, error translation, counting.

The pod list and watch of the port are covered with the pod watch in test_podwatch.py.
"""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from agent.kube import errors, model
from agent.kube.cluster import connect
from agent.kube.errors import ClusterConfigError
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import Condition, EventRecord, LeaseView, ObjectRef
from agent.kube.transport import request_verb
from tests.fakes.apiserver import write_kubeconfig
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.kube.conftest import AGENT_NS, NODE, count


@pytest.mark.parametrize(("method", "path", "query", "verb"), [
    ("GET", "/api/v1/nodes/n1", "", "get"),
    ("GET", "/api/v1/nodes", "watch=true&fieldSelector=metadata.name%3Dn1", "watch"),
    ("GET", "/api/v1/pods", "fieldSelector=spec.nodeName%3Dn1", "list"),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases", "", "list"),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/x", "", "get"),
    ("POST", "/api/v1/namespaces/a/pods/b/eviction", "", "create"),
    ("PATCH", "/api/v1/nodes/n1/status", "", "patch"),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/x", "", "update"),
])
def test_request_verbs(method, path, query, verb):
    assert request_verb(method, path, query) == verb


async def test_node_get_patch_and_condition_merge_by_type(port, api):
    node = await port.get_node()
    assert node.name == NODE and not node.unschedulable
    patched = await port.patch_node({"spec": {"unschedulable": True}}, node.resource_version)
    assert patched.unschedulable and api.node["spec"]["unschedulable"] is True
    assert api.requests[-1].content_type == "application/merge-patch+json"
    with pytest.raises(errors.ApiConflict):
        await port.patch_node({"spec": {"unschedulable": False}}, node.resource_version)  # stale version
    after = await port.patch_node_condition(Condition("GpuUnhealthy", "True", "GpuXid79", "fell off the bus",
                                                      1_800_000_000.0, 1_800_000_000.0))
    assert api.requests[-1].content_type == "application/strategic-merge-patch+json"
    assert set(after.conditions) == {"Ready", "GpuUnhealthy"}  # the kubelet's Ready is untouched
    assert after.conditions["GpuUnhealthy"].last_heartbeat == 1_800_000_000.0
    assert count(port, "get", "200") == 1 and count(port, "patch", "200") == 2 and count(port, "patch", "409") == 1


async def test_pods_are_listed_by_node_only_and_evicted_through_policy_v1(port, api):
    api.add_pod("team", "train-0")
    api.add_pod("team", "elsewhere", node="other-node")
    pods = await port.list_pods()
    assert [p.name for p in pods] == ["train-0"]
    await port.evict_pod("team", "train-0")
    assert api.requests[-1].body["apiVersion"] == "policy/v1"
    with pytest.raises(errors.ApiNotFound):
        await port.evict_pod("team", "train-0")
    api.evictions[("team", "elsewhere")] = [429, 500]
    with pytest.raises(errors.ApiTooManyRequests) as throttled:
        await port.evict_pod("team", "elsewhere")
    assert throttled.value.retry_after == 7.0
    with pytest.raises(errors.ApiServerError) as blocked:
        await port.evict_pod("team", "elsewhere")
    assert blocked.value.code == 500 and "more than one PodDisruptionBudget" in blocked.value.message
    assert count(port, "create", "201") == 1 and count(port, "create", "429") == 1
    assert count(port, "create", "500") == 1 and count(port, "list", "200") == 1


async def test_events_are_created_on_the_node_then_folded(port, api):
    created = await port.write_event(EventRecord("Cordoned", "GpuXid79", "Warning", first_time=1.0e9,
                                                 last_time=1.0e9))
    assert created.name.startswith(f"{NODE}.")
    stored = api.events[created.name]
    assert stored["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
    assert stored["metadata"]["namespace"] == "default" and stored["type"] == "Warning"
    await port.write_event(EventRecord("Cordoned", "GpuXid79", "Warning", created.name, 3, 1.0e9, 1.0e9 + 60))
    assert api.events[created.name]["count"] == 3


async def test_events_about_a_pod_go_to_its_namespace(port, api):
    pod = ObjectRef("Pod", "team", "trainer-0", "uid-1")
    created = await port.write_event(EventRecord("InvalidBandwidthAnnotation", "bad", "Warning", first_time=1.0e9,
                                                 last_time=1.0e9, involved=pod))
    stored = api.events[created.name]
    assert created.name.startswith("trainer-0.") and created.involved == pod
    assert stored["metadata"]["namespace"] == "team"
    assert stored["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team", "name": "trainer-0",
                                        "uid": "uid-1"}


async def test_leases_create_conflict_and_replace(port, api):
    lease = LeaseView("slot-0", NODE, 60.0, 1.0e9, 1.0e9, labels={"x/slot": "true"})
    written = await port.write_lease(AGENT_NS, lease)
    assert written.resource_version and written.holder == NODE
    with pytest.raises(errors.ApiConflict):
        await port.write_lease(AGENT_NS, lease)  # create of an existing name
    listed = await port.list_leases(AGENT_NS, {"x/slot": "true"})
    assert [le.name for le in listed] == ["slot-0"] and listed[0].renew_time == 1.0e9
    renewed = await port.write_lease(AGENT_NS, LeaseView("slot-0", NODE, 60.0, 1.0e9 + 20, 1.0e9, 0,
                                                         written.resource_version, {"x/slot": "true"}))
    with pytest.raises(errors.ApiConflict):  # replace with a stale resourceVersion
        await port.write_lease(AGENT_NS, written)
    assert renewed.renew_time == 1.0e9 + 20
    assert await port.list_leases(AGENT_NS, {"other": "label"}) == []


@pytest.mark.parametrize(("status", "kind", "json_body"), [
    (404, errors.ApiNotFound, True), (409, errors.ApiConflict, True), (429, errors.ApiTooManyRequests, True),
    (500, errors.ApiServerError, True), (503, errors.ApiServerError, False), (403, errors.ApiError, True),
])
async def test_http_errors_become_our_exceptions(port, api, status, kind, json_body):
    api.fail("GET", f"/nodes/{NODE}$", status, json_body=json_body)
    with pytest.raises(kind) as caught:
        await port.get_node()
    assert caught.value.code == status
    assert count(port, "get", str(status)) == 1


async def test_timeouts_and_refused_connections(port, api, tmp_path):
    api.fail("PATCH", f"/nodes/{NODE}/status", 200, delay=1.0)
    with pytest.raises(errors.ApiTimeout):
        await port.patch_node_condition(Condition("GpuUnhealthy", "False"))
    assert count(port, "patch", "timeout") == 1
    registry = CollectorRegistry()
    dead = connect(NODE, ApiRequestCounter(registry), str(write_kubeconfig(tmp_path / "dead", "http://127.0.0.1:9")))
    with pytest.raises(errors.ApiUnavailable):
        await dead.get_node()
    await dead.aclose()
    assert registry.get_sample_value("gpu_node_agent_apiserver_requests_total", {"verb": "get", "code": "error"}) == 1


async def test_watch_by_name_with_bookmarks_until_the_server_timeout(port, api, clock: FakeClock):
    start = (await port.get_node()).resource_version
    seen: list[model.WatchEvent] = []

    async def consume() -> None:
        async for event in port.watch_node(start, 300):
            seen.append(event)

    task = asyncio.create_task(consume())
    await until(lambda: api.open_watches == 1, "the watch is open")
    api.admin_patch({"spec": {"unschedulable": True}})
    await until(lambda: seen, "the MODIFIED event")
    await clock.advance(301)
    await asyncio.wait_for(task, 5)
    assert [e.type for e in seen] == ["MODIFIED", "BOOKMARK"]
    assert seen[0].object is not None and seen[0].object.unschedulable
    assert seen[1].resource_version == str(api.rv)
    query = api.node_requests(watches=True)[0].query
    assert query["allowWatchBookmarks"] == "true" and query["timeoutSeconds"] == "300"
    assert query["resourceVersion"] == start and query["fieldSelector"] == f"metadata.name={NODE}"
    assert count(port, "watch", "200") == 1


async def test_watch_from_a_compacted_version_is_gone(port, api):
    start = (await port.get_node()).resource_version
    api.admin_patch({"metadata": {"labels": {"a": "b"}}})
    api.compact()
    with pytest.raises(errors.ApiGone):
        async for _ in port.watch_node(start, 300):
            pass


async def test_connect_without_credentials_names_the_fix(tmp_path):
    with pytest.raises(ClusterConfigError, match="--kubeconfig"):
        connect(NODE, ApiRequestCounter(CollectorRegistry()), str(tmp_path / "missing"))
    with pytest.raises(ClusterConfigError, match="service account"):
        connect(NODE, ApiRequestCounter(CollectorRegistry()), None)


@pytest.mark.parametrize("name", ["gpu-0/../gpu-1", "gpu-0%2F..%2Fgpu-1", "Gpu-0", "", "gpu-\udcff"])
def test_a_node_name_that_is_not_one_is_refused_before_any_request(tmp_path, name: str) -> None:
    with pytest.raises(ClusterConfigError, match="not a valid Kubernetes node name"):
        connect(name, ApiRequestCounter(CollectorRegistry()), str(write_kubeconfig(tmp_path / "kc", "http://x")))


async def test_names_from_the_cluster_are_checked_and_escaped_in_paths(port, api):
    """A pod or namespace name that is not a Kubernetes name never becomes a request path."""
    before = len(api.requests)
    for namespace, name in (("team", "../../nodes/other"), ("team/../kube-system", "p"), ("team", "a?dryRun=All")):
        with pytest.raises(errors.ApiError) as refused:
            await port.evict_pod(namespace, name)
        assert refused.value.code == 400
    with pytest.raises(errors.ApiError):
        await port.list_leases("../..", {})
    assert len(api.requests) == before  # nothing was sent


async def test_the_node_watch_believes_only_its_own_node(port, api, clock: FakeClock, monkeypatch):
    """A server (or proxy) that ignores the field selector and streams another node is an error, not news."""
    start = (await port.get_node()).resource_version
    monkeypatch.setattr(type(api), "_selects", staticmethod(lambda selector, obj: True))
    other = {**api.node, "metadata": {**api.node["metadata"], "name": "gpu-node-2"}}
    api._write_node(other)
    with pytest.raises(errors.ApiServerError, match="returned node 'gpu-node-2'"):
        async for _ in port.watch_node(start, 300):
            pass


async def test_one_pod_is_found_by_a_namespaced_list_bounded_to_this_node(port, api):
    api.add_pod("team", "train-0")
    api.add_pod("team", "train-1", node="other-node")  # same namespace, another node: never read
    api.add_pod("other", "train-0", node="other-node")
    pod = await port.find_node_pod("team", "train-0")
    assert pod is not None and pod.key == ("team", "train-0") and pod.uid == "uid-team-train-0"
    assert await port.find_node_pod("team", "train-1") is None
    assert await port.find_node_pod("team", "gone") is None
    lists = api.namespaced_pod_requests()
    assert [r.path for r in lists] == ["/api/v1/namespaces/team/pods"] * 3
    assert {frozenset(r.query["fieldSelector"].split(",")) for r in lists} == {
        frozenset({f"metadata.name={n}", f"spec.nodeName={NODE}"}) for n in ("train-0", "train-1", "gone")}
    assert count(port, "list", "200") == 3  # a LIST, which `list pods` grants; never a GET of a pod


async def test_a_bad_pod_name_is_refused_before_any_request(port, api):
    for namespace, name in (("team", "a,spec.nodeName=other"), ("../kube-system", "x"), ("team", "")):
        with pytest.raises(errors.ApiError) as caught:
            await port.find_node_pod(namespace, name)
        assert caught.value.code == 400
    assert api.namespaced_pod_requests() == []


async def test_a_list_answering_with_another_pod_is_not_believed(port, api):
    api.add_pod("team", "train-0")
    api.add_pod("team", "train-9")
    api.pods[("team", "train-9")]["metadata"]["name"] = "train-0"  # a broken server or proxy: two answers
    with pytest.raises(errors.ApiServerError):
        await port.find_node_pod("team", "train-0")


async def test_the_double_selects_fields_as_the_api_server_does(api):
    import httpx2

    api.add_pod("team", "a", phase="Pending")
    api.add_pod("team", "b")
    async with httpx2.AsyncClient(base_url=api.url) as http:
        refused = await http.get("/api/v1/namespaces/team/pods", params={"fieldSelector": "spec.containers=x"})
        both = await http.get("/api/v1/namespaces/team/pods",
                              params={"fieldSelector": f"spec.nodeName=={NODE},status.phase!=Running"})
    assert refused.status_code == 400 and refused.json()["reason"] == "BadRequest"
    assert '"spec.containers" is not a known field selector' in refused.json()["message"]
    assert [p["metadata"]["name"] for p in both.json()["items"]] == ["a"]


async def test_the_in_memory_cluster_finds_only_its_own_pods() -> None:
    from agent.kube.simulated import demo_cluster

    cluster = demo_cluster("n1")
    pod = await cluster.find_node_pod("default", "training-job-0")
    assert pod is not None and pod.key == ("default", "training-job-0")
    assert await cluster.find_node_pod("default", "nope") is None
