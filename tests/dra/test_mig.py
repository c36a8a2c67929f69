"""MIG devices as DRA devices (issue 30 item 4), end to end on `dgx-h100-mig` (GPUs 0-3 in MIG mode with seven
1g.10gb each, 4-7 whole): the slices the service publishes through lightkube into the API double, claims
prepared and unprepared by the stand-in kubelet over the DRA unix socket, CDI specs on disk (capability minors
from the driver's `mig-minors` file as a simulated node carries it, `agent.simulate.nvidia_caps`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.config.model import DraConfig
from agent.dra.devices import device_name, placement_attributes
from agent.dra.health.v1alpha1 import api_pb2 as health_pb2
from agent.kube.cluster import LightkubeCluster
from agent.signals import NodeVerdict, Severity
from agent.simulate import nvidia_caps
from agent.topology.model import Gpu, Level, MigDevice, Topology
from tests.dra.conftest import DRIVER, NODE, device_classes, profile_topology
from tests.dra.test_plugin import UID_A, UID_B, Node, spec_file, started
from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.dra_allocator import allocate
from tests.fakes.kubelet_dra import DraKubelet
from tests.fakes.polling import until

MIG_CLAIM = "mig-1g-vf-one-switch"
ONE_MIG = {"spec": {"devices": {"requests": [
    {"name": "mig", "exactly": {"deviceClassName": "mig.gpunodeagent.io", "count": 1}}]}}}



@pytest.fixture
async def node(short_root: Path, api: ApiServerDouble, port: LightkubeCluster,
               tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    cfg = DraConfig(enabled=True, plugin_registry_dir=str(short_root / "registry"),
                    plugin_dir=str(short_root / "plugins" / DRIVER), cdi_spec_dir=str(short_root / "cdi"))
    dev_root = short_root / "host"
    (dev_root / "dev").mkdir(parents=True)
    (dev_root / "dev" / "nvidiactl").touch()  # the only control node this host has
    minors_file = nvidia_caps.write_mig_minors(short_root / "proc", range(8))
    here = Node(short_root, cfg, api, port, profile_topology("dgx-h100-mig", tmp_path_factory),
                options={"dev_root": str(dev_root), "mig_minors": str(minors_file)})
    yield here
    await here.halt()


def published(api: ApiServerDouble) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in api.resource_slices.values() for d in s["spec"]["devices"]}


def attribute(device: dict[str, Any], name: str) -> Any:
    value = device["attributes"].get(name)
    return None if value is None else next(iter(value.values()))


def mig_devices(topology: Topology) -> list[tuple[Gpu, MigDevice]]:
    return [(gpu, mig) for gpu in topology.gpus for mig in gpu.mig_devices]


async def test_dgx_h100_mig_publishes_4_whole_gpus_and_28_mig_devices(node: Node, kubelet: DraKubelet) -> None:
    service, plugin = await started(node, kubelet)
    devices = published(node.api)
    by_type: dict[str, list[dict[str, Any]]] = {}
    for device in devices.values():
        by_type.setdefault(attribute(device, "gpunodeagent.io/type"), []).append(device)
    assert len(by_type["gpu"]) == 4 and len(by_type["mig"]) == 28
    assert {attribute(d, "gpunodeagent.io/uuid") for d in by_type["gpu"]} == {
        g.uuid for g in node.topology.gpus if not g.mig_enabled}

    migs = {attribute(d, "gpunodeagent.io/uuid"): d for d in by_type["mig"]}
    assert set(migs) == {m.uuid for _, m in mig_devices(node.topology)}
    for gpu, mig in mig_devices(node.topology):
        device = migs[mig.uuid]
        assert device["name"] == f"gpu-{gpu.bus_id.replace(':', '-').replace('.', '-')}-mig-{mig.gpu_instance}-0"
        assert attribute(device, "gpunodeagent.io/migProfile") == "1g.10gb"
        assert attribute(device, "gpunodeagent.io/parentUUID") == gpu.uuid
        # where its parent is: the same bus id, root, NUMA node and switches a whole GPU publishes
        placement = placement_attributes(gpu.bus_id, gpu.location)
        assert {k: v for k, v in device["attributes"].items() if k in placement} == placement
        assert {"resource.kubernetes.io/pcieRoot", "gpunodeagent.io/pcieSwitch"} <= set(placement)
    assert len(devices) == len(service.devices) == 4 + 28 + sum(len(n.vfs) for n in node.topology.rdma_nics)

    (first,) = await plugin.health_updates(1)  # the kubelet's health stream names the same devices
    assert {d.device.device_name for d in first.devices} == set(devices)


async def test_a_gpu_in_mig_mode_is_never_published_whole(node: Node, kubelet: DraKubelet) -> None:
    service, _ = await started(node, kubelet)
    whole_names = {device_name("gpu", g.bus_id) for g in node.topology.gpus}
    mig_mode = [g for g in node.topology.gpus if g.mig_enabled]
    assert len(mig_mode) == 4
    devices = published(node.api)
    assert not {device_name("gpu", g.bus_id) for g in mig_mode} & set(devices)
    assert not {g.uuid for g in mig_mode} & {attribute(d, "gpunodeagent.io/uuid") for d in devices.values()}

    # a repartition seen at a rescan: GPU 0 leaves MIG mode, GPU 1 is in MIG mode with no MIG device yet
    gpu0, gpu1 = mig_mode[0], mig_mode[1]
    rescanned = dataclasses.replace(node.topology, gpus=tuple(
        dataclasses.replace(g, mig_enabled=False, mig_devices=()) if g is gpu0
        else dataclasses.replace(g, mig_devices=()) if g is gpu1 else g for g in node.topology.gpus))
    service.update_topology(rescanned)
    await until(lambda: device_name("gpu", gpu0.bus_id) in published(node.api), "GPU 0 published whole")
    devices = published(node.api)
    assert device_name("gpu", gpu1.bus_id) not in devices  # MIG mode without MIG devices: nothing to hand out
    gone = {f"{device_name('gpu', g.bus_id)}-mig-{m.gpu_instance}-0" for g in (gpu0, gpu1) for m in g.mig_devices}
    assert not gone & set(devices)
    assert {d for d in devices if d.startswith("gpu-")} <= whole_names | {
        f"{device_name('gpu', g.bus_id)}-mig-{m.gpu_instance}-0" for g in mig_mode[2:] for m in g.mig_devices}
    assert sum(attribute(d, "gpunodeagent.io/type") == "mig" for d in devices.values()) == 14


async def test_a_mig_claim_gets_its_mig_uuid_and_capability_nodes_and_survives_a_restart(
        node: Node, kubelet: DraKubelet) -> None:
    service, plugin = await started(node, kubelet)
    claim = node.allocate(UID_A, "mig-vf", MIG_CLAIM)
    results = {r["request"]: r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
    answer = (await plugin.prepare(("default", UID_A, "mig-vf"))).claims[UID_A]
    assert answer.error == "" and {d.device_name for d in answer.devices} == set(results.values())

    mig_device = service.devices[results["mig"]]
    gpu, mig = mig_device.gpu, mig_device.mig
    assert gpu is not None and mig is not None and gpu.minor is not None and mig.profile == "1g.10gb"
    vf = node.topology.find(service.devices[results["vf"]].bus_id)
    assert vf is not None and node.topology.level(gpu.bus_id, vf.bus_id) == Level.PIX  # under its parent's switch

    spec = json.loads(spec_file(node, UID_A).read_text())
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == mig.uuid
    (edits,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == f"{UID_A}-{results['mig']}"]
    minors = nvidia_caps.mig_minors(range(8))
    assert minors["gpu0/gi1/access"] == 12 and minors["gpu0/gi1/ci0/access"] == 13  # NVIDIA's MIG guide's example
    host = node.options["dev_root"]
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidiactl", "hostPath": f"{host}/dev/nvidiactl", "permissions": "rw"},
        {"path": f"/dev/nvidia{gpu.minor}", "hostPath": f"{host}/dev/nvidia{gpu.minor}", "permissions": "rw"},
        {"path": f"/dev/nvidia-caps/nvidia-cap{minors[f'gpu{gpu.minor}/gi{mig.gpu_instance}/access']}",
         "hostPath": f"{host}/dev/nvidia-caps/nvidia-cap{minors[f'gpu{gpu.minor}/gi{mig.gpu_instance}/access']}",
         "permissions": "rw"},
        {"path": f"/dev/nvidia-caps/nvidia-cap{minors[f'gpu{gpu.minor}/gi{mig.gpu_instance}/ci0/access']}",
         "hostPath": f"{host}/dev/nvidia-caps/nvidia-cap"
                     f"{minors[f'gpu{gpu.minor}/gi{mig.gpu_instance}/ci0/access']}",
         "permissions": "rw"}]

    # a second claim cannot take the same MIG device
    node.api.put_claim({"metadata": {"name": "again", "namespace": "default", "uid": UID_B},
                        "spec": {"devices": {"requests": []}},
                        "status": {"allocation": {"devices": {"results": [
                            {"request": "mig", "driver": DRIVER, "pool": NODE, "device": results["mig"]}]}}}})
    refused = (await plugin.prepare(("default", UID_B, "again"))).claims[UID_B]
    assert f"already prepared for claim {UID_A}" in refused.error

    await node.halt()  # a new agent process, the claim gone with its pod: only the state dir remembers
    await kubelet.close()
    node.api.delete_claim("default", "mig-vf")
    _, plugin = await started(node, kubelet)
    assert (await plugin.prepare(("default", UID_A, "mig-vf"))).claims[UID_A] == answer  # retried: same answer
    assert (await plugin.unprepare(("default", UID_A, "mig-vf"))).claims[UID_A].error == ""
    assert not spec_file(node, UID_A).exists()
    assert json.loads((node.root / "state" / "dra-prepared.json").read_text()) == {}


async def test_a_parent_xid_79_takes_its_seven_mig_devices_out(node: Node, kubelet: DraKubelet) -> None:
    service, plugin = await started(node, kubelet)
    sick = next(g for g in node.topology.gpus if g.mig_enabled)
    sick_names = {n for n, d in service.devices.items() if d.gpu == sick}
    assert len(sick_names) == 7

    def effects() -> dict[str, str]:
        return {name: t["effect"] for name, d in published(node.api).items() for t in d.get("taints", [])}

    service.set_device_health(sick.uuid or "", False, "GpuXid79")  # the parent's fault, under the GPU's UUID
    await until(lambda: set(effects()) == sick_names, "the parent's 7 MIG devices tainted, nothing else")
    assert set(effects().values()) == {"NoSchedule"}
    (current,) = await plugin.health_updates(1)
    assert {d.device.device_name for d in current.devices if d.health == health_pb2.UNHEALTHY} == sick_names

    slices = list(node.api.resource_slices.values())  # the scheduler hands out the other 21, never these
    busy: list[tuple[str, str, str]] = []
    while (allocation := allocate(ONE_MIG, device_classes(), slices, busy)) is not None:
        result = allocation["devices"]["results"][0]
        busy.append((result["driver"], result["pool"], result["device"]))
    assert len(busy) == 21 and not {device for _, _, device in busy} & sick_names

    node.verdicts.set(NodeVerdict(Severity.DRAIN, "GpuXid79", devices=(sick.uuid or "",)))
    await until(lambda: set(effects().values()) == {"NoExecute"}, "a drain naming the parent evicts its MIG users")

    service.set_device_health(sick.uuid or "", True)
    await until(lambda: not effects(), "recovered: the taints go")

    one = next(iter(sick.mig_devices))  # a MIG device's own fault (Xid 94 on GPU-I 1) takes only that one
    service.set_device_health(one.uuid, False, "GpuXid94")
    await until(lambda: list(effects()) == [f"{device_name('gpu', sick.bus_id)}-mig-{one.gpu_instance}-0"],
                "only the MIG device named by its fault")


async def test_a_repartition_cannot_hand_a_held_gpu_out_twice(node: Node, kubelet: DraKubelet) -> None:
    """Whole GPU and MIG devices are never published together, but claim A may hold the whole GPU when a rescan
    shows it in MIG mode: a MIG device of it is refused until A is unprepared."""
    gpu = next(g for g in node.topology.gpus if g.mig_enabled)
    partitioned = node.topology
    node.topology = dataclasses.replace(partitioned, gpus=tuple(
        dataclasses.replace(g, mig_enabled=False, mig_devices=()) if g is gpu else g for g in partitioned.gpus))
    service, plugin = await started(node, kubelet)

    def put(uid: str, name: str, device: str) -> None:
        node.api.put_claim({"metadata": {"name": name, "namespace": "default", "uid": uid},
                            "spec": {"devices": {"requests": []}},
                            "status": {"allocation": {"devices": {"results": [
                                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]}}}})

    put(UID_A, "whole", device_name("gpu", gpu.bus_id))
    assert (await plugin.prepare(("default", UID_A, "whole"))).claims[UID_A].error == ""
    service.update_topology(partitioned)
    mig_name = f"{device_name('gpu', gpu.bus_id)}-mig-{gpu.mig_devices[0].gpu_instance}-0"
    await until(lambda: mig_name in published(node.api), "the MIG devices published")
    put(UID_B, "slice", mig_name)
    refused = (await plugin.prepare(("default", UID_B, "slice"))).claims[UID_B]
    assert f"already prepared for claim {UID_A}" in refused.error and not spec_file(node, UID_B).exists()

    assert (await plugin.unprepare(("default", UID_A, "whole"))).claims[UID_A].error == ""
    assert (await plugin.prepare(("default", UID_B, "slice"))).claims[UID_B].error == ""
