"""The kubelet DRA plugin end to end: registration through the plugin watcher, prepare and unprepare over the
unix sockets (v1 and v1beta1), CDI spec files, refusal of bad claims, restarts, health taints.

The stand-in kubelet (`tests.fakes.kubelet_dra`) registers the plugin and calls it; claims live in the HTTP API
double, allocated by the `matchAttribute` stand-in from the slices the service published through lightkube.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.config.model import DraConfig
from agent.dra.health.v1alpha1 import api_pb2 as health_pb2
from agent.dra.service import DraService
from agent.kube.cluster import LightkubeCluster
from agent.signals import Latest, NodeVerdict, Severity
from agent.topology.model import Level, Topology
from tests.dra.conftest import DRIVER, NODE, claim_template, device_classes, profile_topology
from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.dra_allocator import allocate
from tests.fakes.kubelet_dra import DraKubelet, RegisteredPlugin
from tests.fakes.polling import until

UID_A = "0f6b7f1e-1111-4a5b-9c3d-000000000001"
UID_B = "0f6b7f1e-1111-4a5b-9c3d-000000000002"


@dataclasses.dataclass
class Node:
    """One agent's DRA service running against the double, with its directories and the stand-in kubelet."""

    root: Path
    cfg: DraConfig
    api: ApiServerDouble
    port: LightkubeCluster
    topology: Topology
    registry: CollectorRegistry = dataclasses.field(default_factory=CollectorRegistry)
    service: DraService | None = None
    task: asyncio.Task[None] | None = None
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    verdicts: Latest[NodeVerdict] = dataclasses.field(default_factory=Latest)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # more DraService keyword arguments

    async def start(self) -> DraService:
        self.registry = CollectorRegistry()
        self.stop = asyncio.Event()
        self.service = DraService(self.cfg, self.port, self.topology, self.root / "state", registry=self.registry,
                                  verdicts=self.verdicts, **self.options)
        self.task = asyncio.create_task(self.service.run(self.stop))
        return self.service

    async def halt(self) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task

    def claims(self, call: str, result: str) -> float:
        return self.registry.get_sample_value("gpu_node_agent_dra_claims_total", {"call": call, "result": result}) or 0

    def allocate(self, uid: str, name: str, template: str = "gpu-vf-one-switch") -> dict[str, Any]:
        claim = claim_template(template)
        in_use = [(r["driver"], r["pool"], r["device"]) for c in self.api.resource_claims.values()
                  for r in c["status"]["allocation"]["devices"]["results"]]
        allocation = allocate(claim, device_classes(), self.api.resource_slices.values(), in_use)
        assert allocation is not None
        claim["metadata"] = {"name": name, "namespace": "default", "uid": uid}
        claim["status"] = {"allocation": allocation}
        return self.api.put_claim(claim)



@pytest.fixture
async def node(short_root: Path, api: ApiServerDouble, port: LightkubeCluster,
               tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Node]:
    cfg = DraConfig(enabled=True, plugin_registry_dir=str(short_root / "registry"),
                    plugin_dir=str(short_root / "plugins" / DRIVER), cdi_spec_dir=str(short_root / "cdi"))
    here = Node(short_root, cfg, api, port, profile_topology("pcie-pairs", tmp_path_factory))
    yield here
    await here.halt()


async def started(node: Node, kubelet: DraKubelet) -> tuple[DraService, RegisteredPlugin]:
    service = await node.start()
    plugin = await kubelet.register(DRIVER)
    await until(lambda: service.registered.is_set() and node.api.resource_slices, "registered and published")
    return service, plugin


def spec_file(node: Node, uid: str) -> Path:
    return Path(node.cfg.cdi_spec_dir) / f"{DRIVER}-claim_{uid}.json"


async def test_registration_names_the_driver_the_socket_and_v1_first(node: Node, kubelet: DraKubelet) -> None:
    _, plugin = await started(node, kubelet)
    assert plugin.info.type == "DRAPlugin" and plugin.info.name == DRIVER
    assert plugin.info.endpoint == str(Path(node.cfg.plugin_dir) / "dra.sock")
    assert list(plugin.info.supported_versions)[:2] == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert plugin.version == "v1.DRAPlugin"


@pytest.mark.parametrize("versions", [("v1.DRAPlugin",), ("v1beta1.DRAPlugin",)])
async def test_prepare_writes_a_cdi_spec_and_unprepare_removes_it(node: Node, versions: tuple[str, ...]) -> None:
    kubelet = DraKubelet(Path(node.cfg.plugin_registry_dir), versions)
    try:
        _, plugin = await started(node, kubelet)
        assert plugin.version == versions[0]
        claim = node.allocate(UID_A, "gpu-vf")
        response = await plugin.prepare(("default", UID_A, "gpu-vf"))
        answer = response.claims[UID_A]
        assert answer.error == ""
        devices = {d.request_names[0]: d for d in answer.devices}
        assert set(devices) == {"gpu", "vf"} and {d.pool_name for d in devices.values()} == {NODE}
        results = {r["request"]: r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
        assert {k: d.device_name for k, d in devices.items()} == results

        spec = json.loads(spec_file(node, UID_A).read_text())
        assert spec["kind"] == f"{DRIVER}/claim"
        named = {f"{spec['kind']}={d['name']}": d for d in spec["devices"]}
        assert {i for d in devices.values() for i in d.cdi_device_ids} == set(named)
        vf = node.topology.find(node.service.devices[results["vf"]].bus_id)  # type: ignore[union-attr]
        gpu = node.service.devices[results["gpu"]].gpu  # type: ignore[union-attr]
        assert gpu is not None and vf is not None
        assert node.topology.level(gpu.bus_id, vf.bus_id) == Level.PIX
        vf_edits = named[devices["vf"].cdi_device_ids[0]]["containerEdits"]
        assert {n["path"] for n in vf_edits["deviceNodes"]} == {f"/dev/infiniband/{vf.chardevs.uverbs}",
                                                                 "/dev/infiniband/rdma_cm"}
        env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid
        assert env["NCCL_IB_HCA"] == f"={vf.rdma}:1"
        assert env["PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA"] == vf.bus_id

        again = await plugin.prepare(("default", UID_A, "gpu-vf"))  # the kubelet retries: same answer
        assert again.claims[UID_A] == answer

        gone = await plugin.unprepare(("default", UID_A, "gpu-vf"))
        assert gone.claims[UID_A].error == "" and not spec_file(node, UID_A).exists()
        assert (await plugin.unprepare(("default", UID_A, "gpu-vf"))).claims[UID_A].error == ""
        assert node.claims("prepare", "ok") == 2 and node.claims("unprepare", "ok") == 2
    finally:
        await kubelet.close()


async def test_unprepare_after_an_agent_restart_when_the_claim_is_gone(node: Node, kubelet: DraKubelet) -> None:
    _, plugin = await started(node, kubelet)
    node.allocate(UID_A, "gpu-vf")
    assert (await plugin.prepare(("default", UID_A, "gpu-vf"))).claims[UID_A].error == ""
    await node.halt()
    await kubelet.close()
    node.api.delete_claim("default", "gpu-vf")  # the pod ended, the claim went with it

    _, plugin = await started(node, kubelet)  # a new process: only the state dir remembers
    assert spec_file(node, UID_A).exists()
    assert (await plugin.unprepare(("default", UID_A, "gpu-vf"))).claims[UID_A].error == ""
    assert not spec_file(node, UID_A).exists()
    assert json.loads((node.root / "state" / "dra-prepared.json").read_text()) == {}


async def test_bad_claims_get_an_error_each_and_the_rest_is_served(node: Node, kubelet: DraKubelet) -> None:
    _, plugin = await started(node, kubelet)
    good = node.allocate(UID_A, "good")
    taken = good["status"]["allocation"]["devices"]["results"]

    def bad(uid: str, name: str, results: list[dict[str, str]]) -> None:
        node.api.put_claim({"metadata": {"name": name, "namespace": "default", "uid": uid},
                            "spec": {"devices": {"requests": []}},
                            "status": {"allocation": {"devices": {"results": results}}}})

    uids = [f"0f6b7f1e-2222-4a5b-9c3d-00000000000{i}" for i in range(7)]
    bad(uids[0], "other-node", [{"request": "gpu", "driver": DRIVER, "pool": "gpu-node-2", "device": "gpu-x"}])
    bad(uids[1], "unknown", [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0000-ff-00-0"}])
    bad(uids[2], "same-device", [dict(taken[0])])
    bad(uids[3], "other-driver", [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}])
    node.api.put_claim({"metadata": {"name": "unallocated", "namespace": "default", "uid": uids[4]}})
    bad("not-the-uid", "recreated", [])
    response = await plugin.prepare(
        ("default", UID_A, "good"), ("default", uids[0], "other-node"), ("default", uids[1], "unknown"),
        ("default", uids[2], "same-device"), ("default", uids[3], "other-driver"),
        ("default", uids[4], "unallocated"), ("default", uids[5], "missing"), ("default", uids[6], "recreated"),
        ("default", "../../etc", "evil"))
    errors = {uid: answer.error for uid, answer in response.claims.items()}
    assert errors[UID_A] == "" and len(response.claims[UID_A].devices) == 2
    assert "not this node's" in errors[uids[0]]
    assert "not a device of this node" in errors[uids[1]]
    assert f"already prepared for claim {UID_A}" in errors[uids[2]]
    assert errors[uids[3]] == "" and list(response.claims[uids[3]].devices) == []  # left to the other driver
    assert "not allocated" in errors[uids[4]]
    assert "not found" in errors[uids[5]]
    assert "uid" in errors[uids[6]]
    assert "not a UUID" in errors["../../etc"]
    assert node.claims("prepare", "error") == 7
    assert sorted(p.name for p in Path(node.cfg.cdi_spec_dir).iterdir()) == [spec_file(node, UID_A).name]


async def test_unhealthy_gpu_is_tainted_in_the_slice_and_on_the_health_stream(node: Node,
                                                                             kubelet: DraKubelet) -> None:
    service, plugin = await started(node, kubelet)
    sick = node.topology.gpus[2]
    first = (await plugin.health_updates(1))[0]
    assert {d.health for d in first.devices} == {health_pb2.HEALTHY} and len(first.devices) == len(service.devices)

    service.set_device_health(sick.uuid or "", False, "GpuXid79")

    def taints() -> list[dict[str, Any]]:
        return [t for s in node.api.resource_slices.values() for d in s["spec"]["devices"] for t in d.get("taints", [])]

    await until(taints, "a taint in the slice")
    assert [(t["key"], t["value"], t["effect"]) for t in taints()] == [("gpunodeagent.io/unhealthy", "GpuXid79",
                                                                       "NoSchedule")]
    (current,) = await plugin.health_updates(1)
    unhealthy = [d for d in current.devices if d.health == health_pb2.UNHEALTHY]
    assert [(d.device.pool_name, d.device.device_name, d.message) for d in unhealthy] == [
        (NODE, next(n for n, d in service.devices.items() if d.gpu == sick), "GpuXid79")]

    service.set_device_health(sick.uuid or "", True)
    await until(lambda: not taints(), "the taint removed on recovery")


async def test_api_errors_are_retried_and_slices_come_back_after_a_kubelet_wipe(node: Node,
                                                                               kubelet: DraKubelet) -> None:
    node.api.fail("POST", r"/resourceslices$", 503, times=1)
    service, _ = await started(node, kubelet)
    assert (node.registry.get_sample_value("gpu_node_agent_dra_slice_publishes_total", {"result": "error"}) or 0) >= 1
    node.api.resource_slices.clear()  # a starting kubelet deletes every slice of the node, then registers us again
    await kubelet.close()
    await kubelet.register(DRIVER)
    await until(lambda: node.api.resource_slices, "slices republished after re-registration")
    assert sum(len(s["spec"]["devices"]) for s in node.api.resource_slices.values()) == len(service.devices)


async def test_deleted_sockets_are_served_again(node: Node, kubelet: DraKubelet) -> None:
    """A kubelet cleaning its directories (or an operator) removes our sockets: we serve them again, and the
    plugin watcher registers us again."""
    service, _ = await started(node, kubelet)
    registration = Path(node.cfg.plugin_registry_dir) / f"{DRIVER}-reg.sock"
    endpoint = Path(node.cfg.plugin_dir) / "dra.sock"
    for victim in (registration, endpoint):
        victim.unlink()  # anything at this path afterwards was served anew
        await until(victim.is_socket, f"{victim.name} served again")
        await kubelet.close()
        plugin = await kubelet.register(DRIVER)
        await until(service.registered.is_set, "registered again")
    node.allocate(UID_B, "after-restart")
    assert (await plugin.prepare(("default", UID_B, "after-restart"))).claims[UID_B].error == ""


async def test_a_rescan_republishes_the_pool(node: Node, kubelet: DraKubelet) -> None:
    service, _ = await started(node, kubelet)
    generation = next(iter(node.api.resource_slices.values()))["spec"]["pool"]["generation"]
    nic = node.topology.rdma_nics[0]
    smaller = dataclasses.replace(node.topology, nics=tuple(
        dataclasses.replace(n, vfs=n.vfs[:1]) if n is nic else n for n in node.topology.nics))
    service.update_topology(smaller)

    def published() -> list[dict[str, Any]]:
        return [d for s in node.api.resource_slices.values() for d in s["spec"]["devices"]]

    await until(lambda: len(published()) == len(service.devices), "the smaller pool published")
    (current,) = node.api.resource_slices.values()
    assert current["spec"]["pool"]["generation"] == generation + 1
    assert {d["name"] for d in published()} == set(service.devices)
    assert len(service.devices) == len(node.topology.gpus) + sum(len(n.vfs) for n in smaller.rdma_nics)


async def test_a_drain_verdict_turns_the_taint_into_no_execute(node: Node, kubelet: DraKubelet) -> None:
    """NoSchedule keeps running pods; a fault that calls for a drain evicts the pods using the device."""
    service, _ = await started(node, kubelet)
    sick = node.topology.gpus[1]
    nic = node.topology.rdma_nics[0]

    def effects() -> dict[str, str]:
        return {d["name"]: t["effect"] for s in node.api.resource_slices.values() for d in s["spec"]["devices"]
                for t in d.get("taints", [])}

    service.set_device_health(sick.uuid or "", False, "GpuXid79")
    for vf in nic.vfs:
        service.set_device_health(vf.bus_id, False, "NicLinkDown")
    await until(lambda: len(effects()) == 1 + len(nic.vfs), "NoSchedule taints")
    assert set(effects().values()) == {"NoSchedule"}

    node.verdicts.set(NodeVerdict(Severity.DRAIN, "GpuXid79", devices=(sick.uuid or "", nic.bus_id)))
    await until(lambda: set(effects().values()) == {"NoExecute"}, "NoExecute for the GPU and the PF's VFs")

    node.verdicts.set(NodeVerdict(Severity.CORDON, "NicLinkDown", devices=(nic.bus_id,)))
    await until(lambda: set(effects().values()) == {"NoSchedule"}, "back to NoSchedule below drain")


@pytest.mark.parametrize("garbage", [b"{not json", b"[" * 100_000 + b"]" * 100_000], ids=["garbage", "deep"])
async def test_an_unreadable_record_refuses_prepare_instead_of_handing_out_held_devices(
        node: Node, kubelet: DraKubelet, garbage: bytes) -> None:
    """Issue 27, item 7: a garbage record "started empty" and a device held by claim A was prepared for claim B;
    a deeply nested one failed every prepare with gRPC UNKNOWN (RecursionError)."""
    _, plugin = await started(node, kubelet)
    held = node.allocate(UID_A, "a")
    assert (await plugin.prepare(("default", UID_A, "a"))).claims[UID_A].error == ""
    record = node.root / "state" / "dra-prepared.json"
    record.write_bytes(garbage)  # the disk, or a hand, broke the record while A holds its devices
    node.api.put_claim({"metadata": {"name": "b", "namespace": "default", "uid": UID_B},
                        "spec": {"devices": {"requests": []}},
                        "status": {"allocation": {"devices": {"results": held["status"]["allocation"]["devices"]
                                                              ["results"]}}}})
    answer = (await plugin.prepare(("default", UID_B, "b"))).claims[UID_B]
    assert "unknown use" in answer.error and not answer.devices
    assert not spec_file(node, UID_B).exists() and record.read_bytes() == garbage
    assert node.registry.get_sample_value("gpu_node_agent_dra_state_unreadable") == 1
    assert node.claims("prepare", "error") == 1


async def test_one_call_has_one_deadline_and_a_slow_claim_holds_no_other_call(node: Node,
                                                                              kubelet: DraKubelet) -> None:
    """Issue 27, item 6: claims were read one after another under the lock, each bounded only by the API
    timeout: four slow claims made one call take 40 s and another pod's call wait behind it."""
    service, plugin = await started(node, kubelet)
    service.preparer.deadline = 0.8  # the kubelet's 45 s, scaled down
    node.allocate(UID_A, "a")
    node.allocate(UID_B, "b")
    slow = [(f"0f6b7f1e-3333-4a5b-9c3d-00000000000{i}", f"slow-{i}") for i in range(4)]
    for _, name in slow:  # each GET answers only after 1.5 s (under the client's 2 s timeout)
        node.api.fail("GET", f"/resourceclaims/{name}$", 503, delay=1.5)
    loop = asyncio.get_running_loop()
    started_at = loop.time()
    refs = [*(("default", uid, name) for uid, name in slow), ("default", UID_A, "a")]
    first = asyncio.create_task(plugin.prepare(*refs))
    await asyncio.sleep(0.1)
    other = await plugin.prepare(("default", UID_B, "b"))  # another pod's call, while the slow reads are in flight
    assert other.claims[UID_B].error == "" and loop.time() - started_at < 0.6
    answer = await first
    assert loop.time() - started_at < 1.4
    assert answer.claims[UID_A].error == ""
    for uid, _ in slow:
        assert "did not finish within" in answer.claims[uid].error
