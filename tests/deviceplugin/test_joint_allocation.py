"""Joint GPU + NIC preferred allocation through the real gRPC servers and the stand-in kubelet.

The kubelet's call sequence (per container, per resource: GetPreferredAllocation, keep what is free, fill,
Allocate) runs over unix sockets against a manager serving both resources of a simulated profile, in both
resource orders; the level each container achieved is checked on the topology and in the metric.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.metrics import LEVEL_LABELS, AllocationMetrics
from agent.deviceplugin.pools import ResourcePool, build_pools
from agent.deviceplugin.server import DevicePlugin
from agent.deviceplugin.v1beta1 import api_pb2
from agent.placement.joint import JointAllocator
from agent.placement.policy import ContainerRequest, Decision, DeviceKind, Partner, achieved_levels
from agent.signals import DeviceHealthEvent
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from agent.simulate.node import simulated_topology
from agent.topology.model import Level, Topology
from tests.deviceplugin.conftest import dp_config

RDMA = "gpunodeagent.io/sriov_rdma"
GPU = "nvidia.com/gpu"
ORDERS = {"gpu-first": [GPU, RDMA], "nic-first": [RDMA, GPU]}
ALLOCATIONS = "gpu_node_agent_allocations_total"
FAILURES = "gpu_node_agent_preferred_allocation_failures_total"
TIMEOUT = 10.0  # "eventually" bounds only, never timing assertions


def seeded(seed: int) -> random.Random:
    """A reproducible generator for the kubelet's random choices."""
    return random.Random(seed)  # noqa: S311 - simulation, not security


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Topology:
    return simulated_topology("pcie-pairs", Path(tmp_path_factory.mktemp("pairs")))


def counted(registry: CollectorRegistry, resource: str, level: str | None = None) -> float:
    """Allocations counted for `resource` at `level` (all levels when None)."""
    return sum(registry.get_sample_value(ALLOCATIONS, {"resource": resource, "level": name}) or 0
               for name in ([level] if level else LEVEL_LABELS))


@dataclass
class Node:
    """A served topology, its stand-in kubelet and the manager's metrics."""

    topology: Topology
    kubelet: LocalKubelet
    manager: DevicePluginManager
    registry: CollectorRegistry

    def count(self, resource: str, level: str | None = None) -> float:
        """Allocations counted for `resource` at `level` (all levels when None)."""
        return counted(self.registry, resource, level)

    def failures(self) -> dict[tuple[str, str], float]:
        """Non-zero preference failure counts by (resource, reason)."""
        return {(s.labels["resource"], s.labels["reason"]): s.value for metric in self.registry.collect()
                for s in metric.samples if s.name == FAILURES and s.value}

    def levels(self, got: dict[str, list[str]]) -> list[Level]:
        return achieved_levels(self.topology, got.get(GPU, ()), got.get(RDMA, ()))

    def pfs(self, vfs: Iterable[str]) -> Counter[str]:
        return Counter(self.topology.find(vf).pf_bus_id for vf in vfs)


@pytest.fixture
async def node_for(kubelet: LocalKubelet, make_manager) -> Callable[..., Awaitable[Node]]:
    async def make(topology: Topology, serve_gpus: bool = True) -> Node:
        registry = CollectorRegistry()
        manager = await make_manager(dp_config(str(kubelet.directory), serve_gpus=serve_gpus), topology,
                                     registry=registry)
        resources = [RDMA, GPU] if serve_gpus else [RDMA]
        await kubelet.wait_for(lambda: all(
            name in kubelet.plugins and len(kubelet.plugins[name].healthy()) == len(manager.plugin(name).pool.ids)
            for name in resources), TIMEOUT)
        return Node(topology, kubelet, manager, registry)

    return make


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("count", [1, 2, 4, 8])
async def test_dgx_container_gets_pix_for_every_gpu(node_for, dgx: Topology, count: int, order: str) -> None:
    node = await node_for(dgx)
    got = await node.kubelet.admit({GPU: count, RDMA: count}, ORDERS[order])
    assert node.levels(got) == [Level.PIX] * count
    assert len(node.pfs(got[RDMA])) == count  # one VF per PF
    assert node.count(GPU, "pix") == node.count(RDMA, "pix") == 1
    assert node.count(GPU) == node.count(RDMA) == 1
    assert node.failures() == {}


async def test_dgx_mixed_containers_fill_the_node(node_for, dgx: Topology) -> None:
    node = await node_for(dgx)
    for i, count in enumerate([1, 2, 4, 1]):
        got = await node.kubelet.admit({GPU: count, RDMA: count}, ORDERS["nic-first" if i % 2 else "gpu-first"])
        assert node.levels(got) == [Level.PIX] * count, (count, got)
    assert node.kubelet.allocated[GPU] == {gpu.uuid for gpu in dgx.gpus}
    assert node.count(GPU, "pix") == node.count(RDMA, "pix") == 4


@pytest.mark.parametrize("mode", ["alternating", "random"])
async def test_pairs_one_plus_one_pods_until_full(node_for, pairs: Topology, mode: str) -> None:
    node = await node_for(pairs)
    node.kubelet.rng = seeded(4)
    for i in range(len(pairs.gpus)):
        order = None if mode == "random" else ORDERS["nic-first" if i % 2 else "gpu-first"]
        got = await node.kubelet.admit({GPU: 1, RDMA: 1}, order)
        assert node.levels(got) == [Level.PIX], (i, got)
    firsts = [event.resource for event in node.kubelet.events if event.kind == "allocate"][::2]
    assert set(firsts) == {GPU, RDMA}  # both orders occurred
    assert node.kubelet.allocated[GPU] == {gpu.uuid for gpu in pairs.gpus}
    assert node.count(GPU, "pix") == node.count(RDMA, "pix") == len(pairs.gpus)
    with pytest.raises(AdmissionError, match="unavailable"):
        await node.kubelet.admit({GPU: 1, RDMA: 1}, ORDERS["gpu-first"])
    assert node.failures() == {}


async def test_pairs_pods_come_and_go(node_for, pairs: Topology) -> None:
    """Freed devices are seen when one of them is offered again, pairs included: NIC-first stays aligned."""
    node = await node_for(pairs)
    rng = seeded(11)
    running = [await node.kubelet.admit({GPU: 1, RDMA: 1}, ORDERS["gpu-first"]) for _ in pairs.gpus]
    for _ in range(12):
        node.kubelet.release(running.pop(rng.randrange(len(running))))
        got = await node.kubelet.admit({GPU: 1, RDMA: 1}, ORDERS["nic-first"])
        assert node.levels(got) == [Level.PIX], got
        running.append(got)


async def test_nic_only_spreads_over_pfs(node_for, dgx: Topology) -> None:
    node = await node_for(dgx, serve_gpus=False)
    for _ in range(2):
        got = await node.kubelet.admit({RDMA: 4})
        assert len(node.pfs(got[RDMA])) == 4
    assert node.count(RDMA, "none") == node.count(RDMA) == 2


async def test_unhealthy_devices_are_not_chosen(node_for, pairs: Topology) -> None:
    node = await node_for(pairs)
    first_pf = min(pairs.rdma_nics, key=lambda nic: nic.bus_id)
    sick = sorted(vf.bus_id for vf in first_pf.vfs)
    for vf in sick:
        node.manager.device_health.apply(DeviceHealthEvent(vf, False, "test"))
    view = node.kubelet.plugins[RDMA]
    await node.kubelet.wait_for(lambda: all(view.health()[vf] == "Unhealthy" for vf in sick), TIMEOUT)

    # A GPU alone chooses one whose switch still has a healthy NIC, so that the NIC call gets PIX.
    got = await node.kubelet.admit({GPU: 1, RDMA: 1}, ORDERS["gpu-first"])
    assert node.levels(got) == [Level.PIX] and not set(got[RDMA]) & set(sick)

    # A kubelet whose view lags still offers them: never preferred, a partial answer if need be.
    healthy = sorted(view.healthy() - set(got[RDMA]))
    request = api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=sick + healthy, allocation_size=4)])
    reply = await view.stub.GetPreferredAllocation(request)
    assert len(reply.container_responses[0].deviceIDs) == 4
    assert not set(reply.container_responses[0].deviceIDs) & set(sick)
    del request.container_requests[0].available_deviceIDs[len(sick) + 1:]
    reply = await view.stub.GetPreferredAllocation(request)
    assert list(reply.container_responses[0].deviceIDs) == healthy[:1]
    request.container_requests[0].available_deviceIDs.append("0000:ff:1f.7")  # not ours: no preference
    assert await view.stub.GetPreferredAllocation(request) == api_pb2.PreferredAllocationResponse()
    assert node.failures() == {(RDMA, "short"): 1, (RDMA, "invalid_request"): 1}


class _DeafStub:
    """A kubelet that asks for a preference and then ignores it."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.asked = 0

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest,
                                     **kwargs: object) -> api_pb2.PreferredAllocationResponse:
        await self._stub.GetPreferredAllocation(request, **kwargs)
        self.asked += 1
        return api_pb2.PreferredAllocationResponse()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)


@pytest.mark.parametrize("kubelet_kind", ["ignores-answer", "never-asks"])
async def test_kubelet_ignoring_our_preference_still_admits(node_for, pairs: Topology, kubelet_kind: str) -> None:
    node = await node_for(pairs)
    node.kubelet.rng = seeded(9)
    deaf = []
    for name in (GPU, RDMA):
        view = node.kubelet.plugins[name]
        if kubelet_kind == "never-asks":  # an older kubelet, or Topology Manager aligned exactly
            view.options.get_preferred_allocation_available = False
        else:
            view.stub = _DeafStub(view.stub)  # type: ignore[assignment]
            deaf.append(view.stub)
    running = [await node.kubelet.admit({GPU: 1, RDMA: 1}) for _ in pairs.gpus]
    assert node.kubelet.allocated[GPU] == {gpu.uuid for gpu in pairs.gpus}
    assert len({vf for got in running for vf in got[RDMA]}) == len(pairs.gpus)
    assert all(stub.asked == len(pairs.gpus) for stub in deaf)
    assert node.count(GPU) == node.count(RDMA) == len(pairs.gpus)  # every pair still seen and counted
    levels = [node.levels(got)[0].name.lower() for got in running]
    assert node.count(GPU, "pix") == levels.count("pix")
    assert node.failures() == {}


def test_pairing_and_believed_free_follow_the_admission_context(pairs: Topology) -> None:
    now = [0.0]
    registry = CollectorRegistry()
    metrics = AllocationMetrics(registry)
    pools = build_pools(pairs, dp_config("/unused")).by_name()
    gpus, vfs = pools[GPU], pools[RDMA]
    plugins = [DevicePlugin(gpus), DevicePlugin(vfs)]
    allocator = JointAllocator(lambda: plugins, ttl_s=5.0, clock=lambda: now[0])
    gpu0 = pairs.gpus[0]
    near = next(d.id for d in vfs.devices if d.pf.location == gpu0.location)
    far, far2 = [d.id for d in vfs.devices if d.pf.numa != gpu0.numa][:2]

    def count(resource: str, level: str) -> float:
        return counted(registry, resource, level)

    decisions: dict[str, Decision | None] = {}  # the servicer keeps a preference's decision for its Allocate

    def allocated(pool: ResourcePool, ids: list[str]) -> None:  # the servicer counts what the hook returns
        for resource, level in allocator.allocated(pool, ids, decisions.pop(pool.resource_name, None)):
            metrics.allocated(resource, level)

    def prefer(pool: ResourcePool, available: list[str], size: int) -> tuple[str, ...]:
        preference = allocator.prefer(pool, ContainerRequest(served=pool.ids, available=tuple(available),
                                                             size=size))
        decisions[pool.resource_name] = preference.decision
        for resource, level in preference.levels:
            metrics.allocated(resource, level)
        return preference.devices

    allocated(gpus, [gpu0.uuid])  # the kubelet skipped both preference calls
    allocated(vfs, [near])
    assert count(GPU, "pix") == count(RDMA, "pix") == 1
    assert gpu0.uuid not in allocator.other_free(DeviceKind.NIC)

    allocated(gpus, [pairs.gpus[1].uuid])
    now[0] += 6.0  # past the admission context's time-out: no pair
    allocated(vfs, [far])
    assert count(GPU, "none") == 1 and count(RDMA, "none") == 0  # the NIC may still get its GPU
    free_vfs = [d for d in vfs.ids if d not in (near, far, far2)]
    prefer(vfs, free_vfs, 1)  # a NIC call finding no context: that NIC was alone
    assert count(RDMA, "none") == 1

    allocated(gpus, [pairs.gpus[2].uuid])
    preferred = prefer(vfs, free_vfs, 1)  # aligned with GPU 2 (the context)
    assert [vfs.device(vf).pf.location for vf in preferred] == [pairs.gpus[2].location]
    allocated(vfs, [far2])
    assert count(GPU, "sys") == count(RDMA, "sys") == 1

    # GPU 0's pod ends: its VF is offered again, so GPU 0 is free again in the estimate.
    assert gpu0.uuid not in allocator.other_free(DeviceKind.NIC)
    prefer(vfs, [*free_vfs, near], 1)
    assert gpu0.uuid in allocator.other_free(DeviceKind.NIC)
    assert allocator.other_free(DeviceKind.GPU) is not None
    assert JointAllocator(lambda: plugins[1:]).other_free(DeviceKind.NIC) is None  # GPUs not served here


def test_an_allocation_worse_than_an_offered_pix_is_counted_as_missed(pairs: Topology) -> None:
    registry = CollectorRegistry()
    metrics = AllocationMetrics(registry)
    pools = build_pools(pairs, dp_config("/unused")).by_name()
    gpus, vfs = pools[GPU], pools[RDMA]
    allocator = JointAllocator(lambda: [DevicePlugin(vfs)])  # NIC-only: GPUs are another plugin's
    gpu0 = pairs.gpus[0]
    near = next(d.id for d in vfs.devices if d.pf.location == gpu0.location)
    far = next(d.id for d in vfs.devices if d.pf.numa != gpu0.numa)

    def admit(vf: str) -> None:  # the kubelet knows the container's GPU; it may ignore the preference
        preference = allocator.prefer(vfs, ContainerRequest(served=vfs.ids, available=vfs.ids, size=1,
                                                            partner=Partner(held=frozenset([gpu0.uuid or ""]))))
        assert preference.devices == (near,)
        for resource, level in (*preference.levels, *allocator.allocated(vfs, [vf], preference.decision)):
            metrics.allocated(resource, level)

    admit(near)
    admit(far)  # PIX was offered and not taken
    missed = registry.get_sample_value("gpu_node_agent_allocations_pix_missed_total", {"resource": RDMA})
    assert counted(registry, RDMA, "pix") == 1 and counted(registry, RDMA, "sys") == 1 and missed == 1
    assert gpus.kind == "gpu"


def test_a_stale_preference_decision_is_never_applied(pairs: Topology) -> None:
    """The decision a preference returns holds only for the very next call, its own resource's Allocate, within
    the admission time-out and from its offer: otherwise the Allocate counts as one without a preference."""
    now = [0.0]
    registry = CollectorRegistry()
    metrics = AllocationMetrics(registry)
    vfs = build_pools(pairs, dp_config("/unused")).by_name()[RDMA]
    allocator = JointAllocator(lambda: [DevicePlugin(vfs)], ttl_s=5.0, clock=lambda: now[0])  # NIC-only
    gpu0 = pairs.gpus[0]
    near = [d.id for d in vfs.devices if d.pf.location == gpu0.location]

    def prefer(available: Sequence[str]) -> Decision | None:  # the kubelet says the container holds GPU 0
        return allocator.prefer(vfs, ContainerRequest(served=vfs.ids, available=tuple(available), size=1,
                                                      partner=Partner(held=frozenset([gpu0.uuid or ""])))).decision

    def allocate(vf: str, decision: Decision | None) -> None:
        for resource, level in allocator.allocated(vfs, [vf], decision):
            metrics.allocated(resource, level)

    allocate(near[0], prefer(vfs.ids))  # the decision holds: paired with GPU 0 by the fact
    assert counted(registry, RDMA, "pix") == 1
    first = prefer(vfs.ids)
    prefer(vfs.ids)  # another preference came between
    allocate(near[1], first)
    decision = prefer(vfs.ids)
    now[0] += 6.0  # past the admission time-out
    allocate(near[2], decision)
    allocate(near[3], prefer([d for d in vfs.ids if d != near[3]]))  # a device outside the offer
    assert counted(registry, RDMA, "pix") == 1 and counted(registry, RDMA, "none") == 3
    wrong = allocator.prefer(build_pools(pairs, dp_config("/unused")).by_name()[GPU], ContainerRequest(
        served=(gpu0.uuid or "",), available=(gpu0.uuid or "",), size=1)).decision
    allocate(near[0], wrong)  # another resource's decision
    assert counted(registry, RDMA, "none") == 4
