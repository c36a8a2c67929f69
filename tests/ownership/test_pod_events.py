"""Events on the pods holding a device that turned Unhealthy, through the real cluster port and the API double.

The pod specs (and uids) come from the real own-node pod watch against the double; who holds the device comes
from the kubelet's records through the ownership service. Checked on the API double's stored Events: the
namespace, the involvedObject that `kubectl describe pod` selects on, the reason and the message.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.host.podresources.simulated import DeviceRecords, InMemoryPodResources
from agent.kube.cluster import LightkubeCluster, connect
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import PodView
from agent.kube.podwatch import NodePodWatch
from agent.ownership.pod_events import PodDeviceEvents
from agent.ownership.service import OwnershipService
from tests.fakes import fixtures
from tests.fakes.allowed import assert_only_allowed
from tests.fakes.apiserver import ApiServerDouble, container_spec, write_kubeconfig

GPU, NIC = "nvidia.com/gpu", "gpunodeagent.io/sriov_rdma"
UUID = "GPU-3b9a0c4e-1111-2222-3333-444455556666"
VF = "0000:1a:00.2"


@pytest.fixture
async def port(api: ApiServerDouble, tmp_path: Path):
    cluster: LightkubeCluster = connect(fixtures.NODE, ApiRequestCounter(CollectorRegistry()),
                                        str(write_kubeconfig(tmp_path / "kc", api.url)), timeout=0.5)
    yield cluster
    await cluster.aclose()
    assert_only_allowed(api.requests, fixtures.NODE, "gpu-system")


async def _watched(api: ApiServerDouble, port: LightkubeCluster) -> tuple[NodePodWatch, asyncio.Task[None],
                                                                            asyncio.Event]:
    sets: list[tuple[PodView, ...]] = []
    watch = NodePodWatch(port, sets.append, rng=random.Random(1))  # noqa: S311
    stop = asyncio.Event()
    task = asyncio.create_task(watch.run(stop))
    for _ in range(200):
        if watch.synced:
            break
        await asyncio.sleep(0.01)
    return watch, task, stop


async def test_unhealthy_gpu_posts_an_event_on_each_holding_pod(api: ApiServerDouble, port: LightkubeCluster) -> None:
    api.add_pod("team-a", "trainer-0", containers=[container_spec("main", {GPU: 1, NIC: 1})])
    api.add_pod("team-b", "notebook", containers=[container_spec("lab", {GPU: 1})])
    api.add_pod("team-c", "idle", containers=[container_spec("cpu")])
    watch, task, stop = await _watched(api, port)
    records = DeviceRecords()
    records.add_pod("team-a", "trainer-0", ["main"])
    records.record("team-a", "trainer-0", "main", GPU, [UUID])
    records.record("team-a", "trainer-0", "main", NIC, [VF])
    records.add_pod("team-b", "notebook", ["lab"])
    records.record("team-b", "notebook", "lab", GPU, [f"{UUID}::1"])  # a time-sliced replica of the same GPU
    service = OwnershipService(InMemoryPodResources(records), pod_specs=lambda: watch.pods)
    await service.refresh()
    notifier = PodDeviceEvents(port, service)
    try:
        holders = await notifier.device_unhealthy(UUID, "Xid 79 (GPU has fallen off the bus)")
        assert {(h.namespace, h.pod) for h in holders} == {("team-a", "trainer-0"), ("team-b", "notebook")}
        events = sorted(api.events.values(), key=lambda e: e["metadata"]["namespace"])
        assert [e["metadata"]["namespace"] for e in events] == ["team-a", "team-b"]
        first = events[0]
        assert first["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a",
                                           "name": "trainer-0", "uid": "uid-team-a-trainer-0"}
        assert first["reason"] == "GpuDeviceUnhealthy" and first["type"] == "Warning"
        assert UUID in first["message"] and "Xid 79" in first["message"] and "main" in first["message"]

        await notifier.device_unhealthy(UUID, "Xid 79 (GPU has fallen off the bus)")
        assert len(api.events) == 2, "once per pod while the device stays Unhealthy"

        await notifier.device_unhealthy(VF, "link down")
        nic_events = [e for e in api.events.values() if e["reason"] == "NicDeviceUnhealthy"]
        assert len(nic_events) == 1 and nic_events[0]["involvedObject"]["name"] == "trainer-0"

        notifier.device_healthy(UUID)
        await notifier.device_unhealthy(UUID, "Xid 48")
        assert len([e for e in api.events.values() if e["reason"] == "GpuDeviceUnhealthy"]) == 4
    finally:
        stop.set()
        await task


async def test_api_errors_are_logged_not_raised(api: ApiServerDouble, port: LightkubeCluster) -> None:
    records = DeviceRecords()
    records.add_pod("team-a", "trainer-0", ["main"])
    records.record("team-a", "trainer-0", "main", NIC, [VF])
    api.add_pod("team-a", "trainer-0", containers=[container_spec("main", {NIC: 1})])
    service = OwnershipService(InMemoryPodResources(records))  # no pod watch: the uid comes from one pod list
    api.fail("POST", r"/api/v1/namespaces/team-a/events", 500, times=1)
    notifier = PodDeviceEvents(port, service)
    await notifier.device_unhealthy(VF, "link down")
    assert notifier.posted == 0 and not api.events
    await notifier.device_unhealthy(VF, "link down")  # not marked told: the next fault report retries
    assert notifier.posted == 1
    (event,) = api.events.values()
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": "trainer-0",
                                       "uid": "uid-team-a-trainer-0"}


async def test_the_event_goes_to_the_pod_holding_the_device_now_never_to_one_gone(api: ApiServerDouble,
                                                                                 port: LightkubeCluster) -> None:
    """The last poll named job-82 (deleted since); the kubelet now names job-126, which the pod watch has not
    delivered yet: the Event lands on job-126 with its uid, and nothing is posted for job-82."""
    records = DeviceRecords()
    records.add_pod("team", "job-82", ["main"])
    records.record("team", "job-82", "main", GPU, [UUID])
    service = OwnershipService(InMemoryPodResources(records), pod_specs=lambda: {})  # a watch that lags
    await service.refresh()  # the periodic reading: job-82 holds the GPU
    records.remove_pod("team", "job-82")
    records.add_pod("team", "job-126", ["main"])
    records.record("team", "job-126", "main", GPU, [UUID])
    api.add_pod("team", "job-126", containers=[container_spec("main", {GPU: 1})])
    assert [h.pod for h in service.holders(UUID)] == ["job-82"]  # the stale poll
    notifier = PodDeviceEvents(port, service)
    holders = await notifier.device_unhealthy(UUID, "Xid 79")
    assert holders is not None and [h.pod for h in holders] == ["job-126"]
    (event,) = api.events.values()
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Pod", "namespace": "team", "name": "job-126",
                                       "uid": "uid-team-job-126"}


async def test_no_event_for_a_holder_the_api_does_not_know(api: ApiServerDouble, port: LightkubeCluster) -> None:
    records = DeviceRecords()
    records.add_pod("team", "ghost", ["main"])  # the kubelet still lists it; the API says it is gone
    records.record("team", "ghost", "main", GPU, [UUID])
    notifier = PodDeviceEvents(port, OwnershipService(InMemoryPodResources(records)))
    await notifier.device_unhealthy(UUID, "Xid 79")
    assert notifier.posted == 0 and not api.events


async def test_a_kubelet_that_does_not_answer_names_nobody(api: ApiServerDouble, port: LightkubeCluster) -> None:
    records = DeviceRecords()
    records.add_pod("team", "job", ["main"])
    records.record("team", "job", "main", GPU, [UUID])
    api.add_pod("team", "job", containers=[container_spec("main", {GPU: 1})])
    kubelet = InMemoryPodResources(records)
    service = OwnershipService(kubelet, poll_timeout=0.05)
    await service.refresh()
    kubelet.available = False
    assert await PodDeviceEvents(port, service).device_unhealthy(UUID, "Xid 79") is None
    assert not api.events  # the last poll's holder is not told: it may be gone


async def test_no_api_access_posts_nothing_and_still_names_the_holders() -> None:
    records = DeviceRecords()
    records.add_pod("team-a", "trainer-0", ["main"])
    records.record("team-a", "trainer-0", "main", NIC, [VF])
    service = OwnershipService(InMemoryPodResources(records))
    holders = await PodDeviceEvents(None, service).device_unhealthy(VF, "link down")
    assert holders is not None and [(h.pod, h.container) for h in holders] == [("trainer-0", "main")]
    assert await service.pods_holding_now([VF, "GPU-unknown"]) == ["team-a/trainer-0"]  # the condition's message


async def test_a_pod_name_that_is_no_kubernetes_name_never_reaches_a_request_path(api: ApiServerDouble,
                                                                                  port: LightkubeCluster) -> None:
    records = DeviceRecords()
    records.add_pod("../../nodes", "x", ["main"])  # what a broken or hostile kubelet reply could carry
    records.record("../../nodes", "x", "main", NIC, [VF])
    service = OwnershipService(InMemoryPodResources(records))
    await service.refresh()
    notifier = PodDeviceEvents(port, service)
    await notifier.device_unhealthy(VF, "link down")
    assert notifier.posted == 0 and not api.events
    assert not [r for r in api.requests if "events" in r.path]


async def test_a_huge_event_message_is_cut(api: ApiServerDouble, port: LightkubeCluster) -> None:
    """Issue 27: text from outside (a device name, an annotation) reached Events whole."""
    from agent.kube.model import EVENT_MESSAGE_MAX, EventRecord, ObjectRef

    api.add_pod("team", "job", containers=[container_spec("main", {GPU: 1})])
    await port.write_event(EventRecord("GpuDeviceUnhealthy", "device " + "y" * 200_000, "Warning",
                                       involved=ObjectRef("Pod", "team", "job", "uid-team-job")))
    (event,) = api.events.values()
    assert len(event["message"]) <= EVENT_MESSAGE_MAX and event["message"].endswith("more characters)")
