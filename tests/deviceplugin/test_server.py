"""The DevicePlugin servicer over real gRPC on a short unix socket."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agent.config.model import DevicePluginConfig
from agent.deviceplugin.metrics import AllocationMetrics
from agent.deviceplugin.payload import AllocateOptions
from agent.deviceplugin.pools import build_pools
from agent.deviceplugin.registration import PluginServer, check_socket_path
from agent.deviceplugin.server import DevicePlugin
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.host.unixsocket import SocketPathError
from agent.placement.policy import AllocationLevel, Decision, Preference, Reason
from agent.signals import DeviceHealthEvent
from tests.deviceplugin.conftest import GPU_UUIDS, first_list, small_topology

RDMA = "gpunodeagent.io/sriov_rdma"
VFS = ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4", "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4")


def _plugin(name: str = RDMA, **changes: object) -> DevicePlugin:
    config = DevicePluginConfig(serve_gpus=True, **changes)  # type: ignore[arg-type]
    pool = build_pools(small_topology(), config).by_name()[name]
    return DevicePlugin(pool, AllocateOptions.from_config(config))


@pytest.fixture
async def served(sockdir: str) -> AsyncIterator[tuple[DevicePlugin, api_pb2_grpc.DevicePluginStub,
                                                        grpc.aio.Channel]]:
    plugin = _plugin()
    server = PluginServer(plugin, sockdir, "t.sock")
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{server.path}")
    yield plugin, api_pb2_grpc.DevicePluginStub(channel), channel
    await channel.close()
    await server.stop()
    assert not os.path.exists(server.path)  # stop removes the socket


def _preference(available: list[str], must: list[str], size: int) -> api_pb2.PreferredAllocationRequest:
    return api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
        available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)])


async def test_options_advertise_preferred_allocation(served) -> None:
    _, stub, _ = served
    options = await stub.GetDevicePluginOptions(api_pb2.Empty())
    assert options.get_preferred_allocation_available and not options.pre_start_required
    assert await stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=[VFS[0]])) == \
        api_pb2.PreStartContainerResponse()


async def test_list_and_watch_contents(served) -> None:
    _, _, channel = served
    call, devices = await first_list(channel)
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in devices] == [
        (vf, "Healthy", [0 if vf.startswith("0000:1a") else 1]) for vf in VFS]
    call.cancel()


async def test_no_topology_info_when_numa_unknown_or_excluded(sockdir: str) -> None:
    unknown = DevicePlugin(build_pools(small_topology(numa_unknown=True), DevicePluginConfig()).pools[0])
    assert all(not d.HasField("topology") for d in unknown.device_list())
    gpus = _plugin("nvidia.com/gpu")
    assert [(d.ID, d.topology.nodes[0].ID) for d in gpus.device_list()] == [
        (GPU_UUIDS[0], 0), (GPU_UUIDS[1], 0), (GPU_UUIDS[2], 1), (GPU_UUIDS[3], 1)]


def _set_health(plugin: DevicePlugin, device_id: str, healthy: bool, reason: str = "") -> bool:
    """What the health subsystem and the manager do: flip the device in the owner, tell the servicer."""
    event = DeviceHealthEvent(device_id, healthy, reason)
    return plugin.device_health.apply(event) and plugin.health_changed([event])


async def test_two_streams_and_health_flip_and_recovery(served) -> None:
    plugin, _, channel = served
    (call_a, first_a), (call_b, first_b) = await asyncio.gather(first_list(channel), first_list(channel))
    assert len(first_a) == len(first_b) == 6
    assert _set_health(plugin, VFS[4], False, "link down")
    for call in (call_a, call_b):
        update = await asyncio.wait_for(call.read(), 5)
        health = {d.ID: d.health for d in update.devices}
        assert len(health) == 6  # always the full list
        assert health[VFS[4]] == "Unhealthy" and list(health.values()).count("Healthy") == 5
    assert not _set_health(plugin, VFS[4], False, "still down")  # no change, no message
    assert _set_health(plugin, VFS[4], True)
    for call in (call_a, call_b):
        update = await asyncio.wait_for(call.read(), 5)
        assert {d.health for d in update.devices} == {"Healthy"}
    call_a.cancel()
    # a closed stream does not disturb the other one
    _set_health(plugin, VFS[0], False, "xid")
    update = await asyncio.wait_for(call_b.read(), 5)
    assert {d.ID for d in update.devices if d.health == "Unhealthy"} == {VFS[0]}
    plugin.end_streams()
    assert await asyncio.wait_for(call_b.read(), 5) is grpc.aio.EOF


async def test_allocate_rdma_vfs(served) -> None:
    _, stub, _ = served
    reply = await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[VFS[0], VFS[3]]),
        api_pb2.ContainerAllocateRequest(devices_ids=[VFS[1]])]))
    assert len(reply.container_responses) == 2
    first, second = reply.container_responses
    assert sorted(d.host_path for d in first.devices) == [
        "/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs1", "/dev/infiniband/uverbs11"]
    assert all(d.permissions == "rw" and d.container_path == d.host_path for d in first.devices)
    assert first.envs["PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA"] == f"{VFS[0]},{VFS[3]}"
    assert first.envs["NCCL_IB_HCA"] == "=mlx5_1:1,mlx5_11:1"
    info = json.loads(first.envs["PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA_INFO"])
    assert info[VFS[3]]["rdma"]["rdma_dev"] == "mlx5_11"
    assert second.envs["NCCL_IB_HCA"] == "=mlx5_2:1"


async def test_allocate_unknown_ids_is_invalid_argument(served) -> None:
    _, stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=[VFS[0], "0000:ff:00.1", "GPU-nope"])]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "0000:ff:00.1" in caught.value.details() and "GPU-nope" in caught.value.details()
    assert VFS[0] not in caught.value.details()


async def test_preferred_allocation_honours_must_include_and_size(served) -> None:
    _, stub, _ = served
    reply = await stub.GetPreferredAllocation(_preference(list(VFS), [VFS[4]], 3))
    chosen = list(reply.container_responses[0].deviceIDs)
    assert len(chosen) == 3 and VFS[4] in chosen and set(chosen) <= set(VFS)
    reply = await stub.GetPreferredAllocation(_preference([VFS[5], VFS[1]], [], 2))
    assert sorted(reply.container_responses[0].deviceIDs) == [VFS[1], VFS[5]]


@pytest.mark.parametrize(("available", "must", "size"), [
    (list(VFS), [], 0),  # size not positive
    (list(VFS), [], -2),
    ([VFS[0], "0000:ee:00.2"], [], 1),  # unknown available ID
    (list(VFS), ["0000:ee:00.2"], 1),  # unknown must_include ID
    ([VFS[0], VFS[1]], [VFS[2]], 2),  # must_include not available
    (list(VFS), [VFS[0], VFS[1], VFS[2]], 2),  # must_include larger than size
    ([VFS[0]], [], 2),  # too few available
])
async def test_preferred_allocation_bad_input_is_empty_never_an_error(served, available, must, size) -> None:
    _, stub, _ = served
    reply = await stub.GetPreferredAllocation(_preference(available, must, size))
    assert reply == api_pb2.PreferredAllocationResponse()


async def test_preferred_allocation_policy_failure_is_empty(sockdir: str) -> None:
    def broken(*_: object) -> list[str]:
        raise RuntimeError("policy bug")

    registry = CollectorRegistry()
    plugin = DevicePlugin(_plugin().pool, policy=broken, metrics=AllocationMetrics(registry))
    server = PluginServer(plugin, sockdir, "p.sock")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{server.path}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        reply = await stub.GetPreferredAllocation(_preference(list(VFS), [], 1))
    await server.stop()
    assert reply == api_pb2.PreferredAllocationResponse()
    assert registry.get_sample_value("gpu_node_agent_preferred_allocation_failures_total",
                                     {"resource": RDMA, "reason": "policy_error"}) == 1


async def test_allocate_gpus(sockdir: str) -> None:
    plugin = _plugin("nvidia.com/gpu", gpu_cdi=True)
    server = PluginServer(plugin, sockdir, "g.sock")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{server.path}") as channel:
        reply = await api_pb2_grpc.DevicePluginStub(channel).Allocate(api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[GPU_UUIDS[1], GPU_UUIDS[3]])]))
    await server.stop()
    response = reply.container_responses[0]
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == f"{GPU_UUIDS[1]},{GPU_UUIDS[3]}"
    assert [d.name for d in response.cdi_devices] == [f"nvidia.com/gpu={GPU_UUIDS[1]}",
                                                      f"nvidia.com/gpu={GPU_UUIDS[3]}"]


def test_socket_path_limit() -> None:
    assert check_socket_path("/" + "d" * 106) == "/" + "d" * 106
    with pytest.raises(SocketPathError, match="108 bytes; the limit is 107"):
        check_socket_path("/" + "d" * 107)
    with pytest.raises(SocketPathError):
        PluginServer(_plugin(), "/tmp/" + "x" * 100, "gna-sriov_rdma.sock")


async def test_allocate_names_a_device_once_and_echoes_a_bounded_list(served) -> None:
    _, stub, _ = served
    reply = await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
        api_pb2.ContainerAllocateRequest(devices_ids=[VFS[0], VFS[0], VFS[0]])]))
    (only,) = reply.container_responses
    assert only.envs["PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA"] == VFS[0]
    assert sorted(d.host_path for d in only.devices) == ["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs1"]
    bogus = [f"0000:ff:{i // 8:02x}.{i % 8}" for i in range(2000)] + ["x" * 5000]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=bogus)]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details()
    assert "0000:ff:00.0" in details and "and 1993 more" in details and len(details) < 1000


async def test_a_preference_that_decided_nothing_leaves_no_decision_for_the_allocate(sockdir: str) -> None:
    """The decision handed to the Allocate hook is the last preference call's only: one after it that decided
    nothing (an invalid request, a policy failure) drops it, so it is never applied to another container."""
    decision = Decision(resource=RDMA, offered=frozenset(VFS), partner=None, completes=False, pix_possible=False,
                        stamp=1, at=0.0)
    answers: list[Preference | Exception] = [Preference((VFS[0],), decision=decision),
                                             Preference((), Reason.INVALID_REQUEST, "bad"),
                                             Preference((VFS[0],), decision=decision), RuntimeError("policy bug")]
    handed: list[Decision | None] = []

    def policy(*_: object) -> Preference:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def hook(_pool: object, _ids: object, given: Decision | None) -> list[AllocationLevel]:
        handed.append(given)
        return []

    plugin = DevicePlugin(_plugin().pool, policy=policy, on_allocate=hook)
    server = PluginServer(plugin, sockdir, "d.sock")
    await server.start()
    async with grpc.aio.insecure_channel(f"unix://{server.path}") as channel:
        stub = api_pb2_grpc.DevicePluginStub(channel)
        for _ in range(2):
            await stub.GetPreferredAllocation(_preference(list(VFS), [], 1))  # decided
            await stub.GetPreferredAllocation(_preference(list(VFS), [], 1))  # decided nothing
            await stub.Allocate(api_pb2.AllocateRequest(container_requests=[
                api_pb2.ContainerAllocateRequest(devices_ids=[VFS[0]])]))
    await server.stop()
    assert handed == [None, None]
