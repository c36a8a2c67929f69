"""The two targets over the real cluster port and the HTTP API double: one request per change, keys the agent
stops owning removed, foreign labels and other owners left alone, a conflicting writer read again."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.kube.cluster import connect
from agent.kube.errors import ApiConflict
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import OwnerRef
from agent.labels.facts import Reading
from agent.labels.publish import NodeFeatureTarget, NodeTarget
from agent.labels.service import NodeLabelService
from agent.signals import DeviceHealth
from tests.fakes.apiserver import ApiServerDouble, write_kubeconfig
from tests.fakes.fixtures import NODE, api, clock  # noqa: F401  (fixtures)

NS = "gpu-node-agent"
POD = OwnerRef("v1", "Pod", "agent-1", "pod-uid-1")
DS = OwnerRef("apps/v1", "DaemonSet", "gpu-node-agent", "ds-uid", controller=True)


@pytest.fixture
async def port(api: ApiServerDouble, tmp_path: Path):  # noqa: F811
    cluster = connect(NODE, ApiRequestCounter(CollectorRegistry()), str(write_kubeconfig(tmp_path / "kc", api.url)),
                      timeout=2.0)
    yield cluster
    await cluster.aclose()


async def test_the_node_target_removes_a_key_it_stops_owning_and_nothing_else(api, port):  # noqa: F811
    api.admin_patch({"metadata": {"labels": {"nvidia.com/gpu.count": "theirs", "team/x": "y"}}})
    target = NodeTarget(port)
    assert await target.read() == {}
    assert await target.write({"gpunodeagent.io/a": "1", "gpunodeagent.io/b": "2", "nvidia.com/gpu.count": "8"})
    assert api.labels["nvidia.com/gpu.count"] == "theirs"  # foreign: never touched
    assert api.annotations["gpunodeagent.io/labels"] == "gpunodeagent.io/a,gpunodeagent.io/b"
    assert not await target.write({"gpunodeagent.io/a": "1", "gpunodeagent.io/b": "2"})  # nothing differs
    assert await target.write({"gpunodeagent.io/a": "1"})
    assert "gpunodeagent.io/b" not in api.labels and api.labels["gpunodeagent.io/a"] == "1"
    assert api.labels["team/x"] == "y" and api.labels["kubernetes.io/hostname"] == NODE
    assert await NodeTarget(port).read() == {"gpunodeagent.io/a": "1"}  # a restart reads back what it owns


async def test_the_nodefeature_keeps_other_owners_and_a_conflict_is_read_again(api, port):  # noqa: F811
    target = NodeFeatureTarget(port, NS, [DS, POD])
    assert await target.read() == {}
    assert await target.write({"gpunodeagent.io/a": "1"})
    stored = api.node_features[(NS, f"gpu-node-agent-{NODE}")]
    assert [o["uid"] for o in stored["metadata"]["ownerReferences"]] == ["ds-uid", "pod-uid-1"]
    assert not await target.write({"gpunodeagent.io/a": "1"})
    # someone else writes the object (and adds an owner) after the agent read it
    other = {**stored, "metadata": {**stored["metadata"], "ownerReferences": [
        *stored["metadata"]["ownerReferences"], {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "n"}]}}
    api.put_node_feature(NS, other)
    with pytest.raises(ApiConflict):
        await target.write({"gpunodeagent.io/a": "2"})
    assert await target.write({"gpunodeagent.io/a": "2"})  # read again, then replaced
    stored = api.node_features[(NS, f"gpu-node-agent-{NODE}")]
    assert stored["spec"]["labels"] == {"gpunodeagent.io/a": "2"}
    assert {o["uid"] for o in stored["metadata"]["ownerReferences"]} == {"ds-uid", "pod-uid-1", "n"}
    # a new Pod (rollout): its reference replaces the old Pod's, the DaemonSet's stays
    rolled = NodeFeatureTarget(port, NS, [DS, OwnerRef("v1", "Pod", "agent-2", "pod-uid-2")])
    assert await rolled.read() == {"gpunodeagent.io/a": "2"}
    assert await rolled.write({"gpunodeagent.io/a": "2"})
    owners = api.node_features[(NS, f"gpu-node-agent-{NODE}")]["metadata"]["ownerReferences"]
    assert {o["uid"] for o in owners} == {"ds-uid", "pod-uid-2", "n"}


class _Reader:
    """Readings handed in by the test (the service's only view of the sources)."""

    def __init__(self, topology) -> None:
        self.reading = Reading({})
        self.topology = lambda: topology

    async def read(self) -> Reading:
        return self.reading


async def test_a_failed_source_keeps_the_published_value_and_the_first_write_waits(api, port, tmp_path):  # noqa: F811
    from agent.topology.model import Topology

    registry = CollectorRegistry()
    reader = _Reader(Topology())
    service = NodeLabelService(reader, DeviceHealth(), registry)  # type: ignore[arg-type]
    target = NodeFeatureTarget(port, NS)
    service.target = target
    reader.reading = Reading({"gfd": None, "topology": {"gpunodeagent.io/topology.source": "sysfs"}},
                             {"gfd": "NVML: down"})
    await service.step(full=True)
    assert not api.node_features  # GFD's keys were never known: nothing published, not even a partial set
    reader.reading = Reading({"gfd": {"nvidia.com/gpu.count": "8"},
                              "topology": {"gpunodeagent.io/topology.source": "sysfs"}})
    await service.step(full=True)
    assert api.node_features[(NS, f"gpu-node-agent-{NODE}")]["spec"]["labels"] == {
        "nvidia.com/gpu.count": "8", "gpunodeagent.io/topology.source": "sysfs", "gpunodeagent.io/gpu.healthy": "0"}
    # a new process: NVML fails from the start, yet what was published stands and nothing is written
    restarted = NodeLabelService(reader, DeviceHealth(), CollectorRegistry())  # type: ignore[arg-type]
    restarted.target = NodeFeatureTarget(port, NS)
    reader.reading = Reading({"gfd": None, "topology": {"gpunodeagent.io/topology.source": "sysfs"}})
    writes = len(api.feature_requests(writes=True))
    await restarted.step(full=True)
    assert len(api.feature_requests(writes=True)) == writes
    assert registry.get_sample_value("gpu_node_agent_node_label_writes_total", {"outcome": "ok"}) == 1.0
