"""The in-memory cluster (the `--simulate` twin of the API port) keeps ResourceSlices and ResourceClaims with the
semantics the publisher and the preparer rely on: per-node/driver listing, create-409, replace-409, delete-404."""

from __future__ import annotations

import pytest

from agent.dra.slices import SlicePublisher
from agent.kube.errors import ApiConflict, ApiNotFound
from agent.kube.simulated import InMemoryCluster


async def test_slices_and_claims_in_memory() -> None:
    cluster = InMemoryCluster("node-a")
    publisher = SlicePublisher(cluster, "gpunodeagent.io")
    device = {"name": "gpu-0000-1b-00-0", "attributes": {"gpunodeagent.io/type": {"string": "gpu"}}}
    assert (await publisher.publish([device])).generation == 1
    assert not (await publisher.publish([device])).changed
    (stored,) = await cluster.list_resource_slices("gpunodeagent.io")
    assert stored["spec"]["nodeName"] == "node-a" and await cluster.list_resource_slices("other.io") == []
    with pytest.raises(ApiConflict):
        await cluster.create_resource_slice(stored)
    stale = {**stored, "metadata": {**stored["metadata"], "resourceVersion": "0"}}
    with pytest.raises(ApiConflict):
        await cluster.replace_resource_slice(stale)
    await cluster.delete_resource_slice(stored["metadata"]["name"])
    with pytest.raises(ApiNotFound):
        await cluster.delete_resource_slice(stored["metadata"]["name"])

    cluster.add_resource_claim({"metadata": {"name": "c", "namespace": "ns", "uid": "u"}})
    assert (await cluster.get_resource_claim("ns", "c"))["metadata"]["uid"] == "u"
    with pytest.raises(ApiNotFound):
        await cluster.get_resource_claim("ns", "gone")
