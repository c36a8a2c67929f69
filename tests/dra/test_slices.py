"""ResourceSlices of the simulated profiles: attributes, API limits, generations, stale slices, and what a
`matchAttribute` allocator makes of them (GPU and VF under one PCIe switch, also on the VM profile).

Slices are written through the real lightkube port to the HTTP API double, which validates them as the API
server does; the allocator is `tests.fakes.dra_allocator` with the DeviceClasses and claim templates we ship.
"""

from __future__ import annotations

import dataclasses

import kubernetes_validate
import pytest

from agent.dra.devices import AttributeLimitError, check_device, node_devices
from agent.dra.pool import DeviceFault, device_entries
from agent.dra.slices import SlicePublisher, slice_name
from agent.kube.cluster import LightkubeCluster
from agent.topology.model import Level, Topology
from tests.dra.conftest import (
    DRIVER,
    NODE,
    PROFILES,
    RDMA_RESOURCE,
    claim_template,
    device_classes,
    profile_topology,
)
from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.dra_allocator import allocate

SWITCH = "gpunodeagent.io/pcieSwitch"
ROOT = "resource.kubernetes.io/pcieRoot"


@pytest.fixture(params=PROFILES)
def profile(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Topology]:
    return request.param, profile_topology(request.param, tmp_path_factory)


def entries(topology: Topology, faults: dict[str, DeviceFault] | None = None) -> list[dict]:
    return device_entries(node_devices(topology, RDMA_RESOURCE), faults or {})


def test_every_device_carries_its_placement_and_identity(profile: tuple[str, Topology]) -> None:
    _, topology = profile
    devices = node_devices(topology, RDMA_RESOURCE)
    gpus = [d for d in devices if d.kind == "gpu"]
    assert [d.gpu.uuid for d in gpus if d.gpu] == [g.uuid for g in topology.gpus]
    for device in devices:
        attrs = device.attributes
        assert attrs["resource.kubernetes.io/pciBusID"] == {"string": device.bus_id}
        assert set(attrs["resource.kubernetes.io/numaNode"]) == {"int"}
        assert attrs[ROOT]["string"].startswith("pci")
        if device.kind == "rdma":
            assert attrs["k8s.cni.cncf.io/deviceID"] == {"string": device.bus_id}
            assert attrs["k8s.cni.cncf.io/resourceName"] == {"string": RDMA_RESOURCE}
            assert {"gpunodeagent.io/rdmaDevice", "gpunodeagent.io/pfName", "gpunodeagent.io/linkType"} <= set(attrs)
        else:
            assert {"gpunodeagent.io/uuid", "gpunodeagent.io/product"} <= set(attrs)


def test_switch_attribute_is_equal_exactly_for_pix(profile: tuple[str, Topology]) -> None:
    """pcieSwitch equal <=> the topology says PIX; pcieSwitchGroup equal <=> PXB or closer."""
    _, topology = profile
    devices = node_devices(topology, RDMA_RESOURCE)
    for a in devices:
        for b in devices:
            if a is b:
                continue
            level = topology.level(a.bus_id, b.bus_id)
            same_switch = SWITCH in a.attributes and a.attributes.get(SWITCH) == b.attributes.get(SWITCH)
            assert same_switch == (level <= Level.PIX), (a.name, b.name, level)
            group = "gpunodeagent.io/pcieSwitchGroup"
            assert (group in a.attributes and a.attributes[group] == b.attributes.get(group)) == (level <= Level.PXB)


def test_names_are_stable_dns_labels(profile: tuple[str, Topology]) -> None:
    _, topology = profile
    first = [d.name for d in node_devices(topology, RDMA_RESOURCE)]
    again = [d.name for d in node_devices(dataclasses.replace(topology), RDMA_RESOURCE)]
    assert first == again and len(set(first)) == len(first)
    assert all(name.startswith(("gpu-", "rdma-")) for name in first)


def test_limits_are_checked() -> None:
    with pytest.raises(AttributeLimitError, match="DNS label"):
        check_device("GPU_0", {})
    with pytest.raises(AttributeLimitError, match="longer than 64"):
        check_device("gpu-0", {"gpunodeagent.io/product": {"string": "x" * 65}})
    with pytest.raises(AttributeLimitError, match="33 attributes"):
        check_device("gpu-0", {f"gpunodeagent.io/a{i}": {"int": i} for i in range(33)})


async def test_published_slices_are_valid_and_complete(api: ApiServerDouble, port: LightkubeCluster,
                                                       profile: tuple[str, Topology]) -> None:
    _, topology = profile
    result = await SlicePublisher(port, DRIVER).publish(entries(topology))
    assert result.changed and result.generation == 1 and result.slices == 1
    (stored,) = api.resource_slices.values()
    assert stored["metadata"]["name"] == slice_name(NODE, DRIVER, 0)
    assert stored["metadata"]["ownerReferences"][0] | {"kind": "Node", "name": NODE, "uid": "uid-1"} == \
        stored["metadata"]["ownerReferences"][0]
    assert stored["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    for version in ("1.34", kubernetes_validate.latest_version()):
        kubernetes_validate.validate(stored, version, strict=True)


async def test_unchanged_pool_writes_nothing_and_a_change_bumps_the_generation(
        api: ApiServerDouble, port: LightkubeCluster, tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology("dgx-h100", tmp_path_factory)
    publisher = SlicePublisher(port, DRIVER)
    await publisher.publish(entries(topology))
    writes = len([r for r in api.requests if r.method != "GET"])
    assert not (await publisher.publish(entries(topology))).changed
    assert len([r for r in api.requests if r.method != "GET"]) == writes
    # a restarted agent (new publisher) finds its slices by name and does not add new ones
    assert not (await SlicePublisher(port, DRIVER).publish(entries(topology))).changed

    # one tainted GPU: 72 devices no longer fit one slice (64 with taints); generation 2 in both slices
    uuid = topology.gpus[3].uuid or ""
    result = await publisher.publish(entries(topology, {uuid: DeviceFault("GpuXid79")}))
    assert (result.changed, result.generation, result.slices) == (True, 2, 2)
    pools = [s["spec"]["pool"] for s in api.resource_slices.values()]
    assert pools == [{"name": NODE, "generation": 2, "resourceSliceCount": 2}] * 2
    assert sum(len(s["spec"]["devices"]) for s in api.resource_slices.values()) == 72

    # recovery: back to one slice; the second is deleted, not left stale
    result = await publisher.publish(entries(topology))
    assert (result.generation, result.slices, result.deleted) == (3, 1, 1)
    assert list(api.resource_slices) == [slice_name(NODE, DRIVER, 0)]


async def test_foreign_slices_are_left_alone(api: ApiServerDouble, port: LightkubeCluster,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology("pcie-pairs", tmp_path_factory)
    other = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
             "metadata": {"name": "other-node-gpunodeagent.io-0", "resourceVersion": "1"},
             "spec": {"driver": DRIVER, "nodeName": "other-node",
                      "pool": {"name": "other-node", "generation": 9, "resourceSliceCount": 1}, "devices": []}}
    api.resource_slices[other["metadata"]["name"]] = other
    result = await SlicePublisher(port, DRIVER).publish(entries(topology))
    assert result.generation == 1 and other["metadata"]["name"] in api.resource_slices


def _switch_of(topology: Topology, slices: list[dict], allocation: dict) -> set[str]:
    by_name = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    return {by_name[r["device"]]["attributes"][SWITCH]["string"] for r in allocation["devices"]["results"]}


async def test_one_gpu_one_vf_under_one_switch(api: ApiServerDouble, port: LightkubeCluster,
                                               profile: tuple[str, Topology]) -> None:
    name, topology = profile
    await SlicePublisher(port, DRIVER).publish(entries(topology))
    slices = list(api.resource_slices.values())
    allocation = allocate(claim_template("gpu-vf-one-switch"), device_classes(), slices)
    assert allocation is not None, name
    results = allocation["devices"]["results"]
    assert [r["request"] for r in results] == ["gpu", "vf"]
    bus = {d["name"]: d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
           for s in slices for d in s["spec"]["devices"]}
    assert topology.level(bus[results[0]["device"]], bus[results[1]["device"]]) == Level.PIX
    assert len(_switch_of(topology, slices, allocation)) == 1

    # the same claim on the standard root attribute: on the VM every device has its own root, so nothing matches
    by_root = claim_template("gpu-vf-one-switch")
    by_root["spec"]["devices"]["constraints"][0]["matchAttribute"] = ROOT
    assert (allocate(by_root, device_classes(), slices) is None) == (name == "vm-flat")


async def test_eight_pairs_each_under_its_switch(api: ApiServerDouble, port: LightkubeCluster,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology("dgx-h100", tmp_path_factory)
    await SlicePublisher(port, DRIVER).publish(entries(topology))
    slices = list(api.resource_slices.values())
    allocation = allocate(claim_template("gpu-vf-8-pairs"), device_classes(), slices)
    assert allocation is not None
    by_request = {r["request"]: r["device"] for r in allocation["devices"]["results"]}
    bus = {d["name"]: d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
           for s in slices for d in s["spec"]["devices"]}
    assert len({by_request[f"gpu-{i}"] for i in range(8)}) == 8
    for i in range(8):
        assert topology.level(bus[by_request[f"gpu-{i}"]], bus[by_request[f"vf-{i}"]]) == Level.PIX


async def test_unhealthy_gpu_is_tainted_skipped_and_recovers(api: ApiServerDouble, port: LightkubeCluster,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology("pcie-pairs", tmp_path_factory)
    publisher = SlicePublisher(port, DRIVER)
    sick = topology.gpus[0]
    await publisher.publish(entries(topology, {sick.uuid or "": DeviceFault("GpuXid79: fell off the bus")}))
    slices = list(api.resource_slices.values())
    device = next(d for s in slices for d in s["spec"]["devices"] if d["name"] == "gpu-" + sick.bus_id.replace(
        ":", "-").replace(".", "-"))
    assert device["taints"][0] | {"key": "gpunodeagent.io/unhealthy", "effect": "NoSchedule"} == device["taints"][0]
    one_gpu = {"spec": {"devices": {"requests": [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.gpunodeagent.io", "count": 1}}]}}}
    busy: list[tuple[str, str, str]] = []
    for _ in range(len(topology.gpus) - 1):  # every GPU but the sick one can be handed out
        allocation = allocate(one_gpu, device_classes(), slices, busy)
        assert allocation is not None
        result = allocation["devices"]["results"][0]
        assert result["device"] != device["name"]
        busy.append((result["driver"], result["pool"], result["device"]))
    assert allocate(one_gpu, device_classes(), slices, busy) is None

    await publisher.publish(entries(topology))  # recovered: the taint goes
    slices = list(api.resource_slices.values())
    assert not any(d.get("taints") for s in slices for d in s["spec"]["devices"])
    assert allocate(one_gpu, device_classes(), slices, busy)["devices"]["results"][0]["device"] == device["name"]


async def test_drain_faults_taint_no_execute(api: ApiServerDouble, port: LightkubeCluster,
                                             tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology("vm-flat", tmp_path_factory)
    vf = node_devices(topology, RDMA_RESOURCE)[-1]
    await SlicePublisher(port, DRIVER).publish(entries(topology, {vf.health_id: DeviceFault("NicDown", drain=True)}))
    (stored,) = api.resource_slices.values()
    taints = next(d["taints"] for d in stored["spec"]["devices"] if d["name"] == vf.name)
    assert [(t["key"], t["value"], t["effect"]) for t in taints] == [("gpunodeagent.io/unhealthy", "NicDown",
                                                                     "NoExecute")]
