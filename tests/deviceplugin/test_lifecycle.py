"""The manager against the stand-in kubelet: registration, restarts, absence, health, rescans, admission."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest

from agent.config.model import PoolConfig, SelectorConfig
from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.v1beta1 import api_pb2
from agent.signals import DeviceHealthEvent
from agent.simulate.kubelet import AdmissionError, LocalKubelet
from tests.deviceplugin.conftest import FAST, GPU_UUIDS, dp_config, small_topology, without_nic
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until

RDMA = "gpunodeagent.io/sriov_rdma"
GPU = "nvidia.com/gpu"
VFS = ("0000:1a:00.2", "0000:1a:00.3", "0000:1a:00.4", "0000:9a:00.2", "0000:9a:00.3", "0000:9a:00.4")
TIMEOUT = 10.0  # generous: these are "eventually" checks, never timing assertions


def _listed(kubelet: LocalKubelet, resource: str) -> dict[str, str]:
    view = kubelet.plugins.get(resource)
    return view.health() if view is not None else {}


def _both_listed(kubelet: LocalKubelet) -> Callable[[], bool]:
    return lambda: len(_listed(kubelet, RDMA)) == 6 and len(_listed(kubelet, GPU)) == 4


async def test_registers_each_resource(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir))
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)
    assert sorted(r.resource_name for r in kubelet.registrations) == [RDMA, GPU]
    for request in kubelet.registrations:
        assert request.version == "v1beta1"
        assert request.endpoint == manager.endpoint(request.resource_name)
        assert "/" not in request.endpoint
        assert request.options.get_preferred_allocation_available
        assert os.path.exists(os.path.join(sockdir, request.endpoint))
    await kubelet.wait_for(_both_listed(kubelet), TIMEOUT)
    assert _listed(kubelet, RDMA) == dict.fromkeys(VFS, "Healthy")
    assert _listed(kubelet, GPU) == dict.fromkeys(GPU_UUIDS, "Healthy")
    assert kubelet.plugins[GPU].options.get_preferred_allocation_available  # read on dial-back


async def test_stop_removes_sockets_and_leaves_no_tasks(kubelet: LocalKubelet, sockdir: str) -> None:
    before = asyncio.all_tasks()
    manager = DevicePluginManager(dp_config(sockdir), small_topology(), **FAST)
    await manager.start()
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)
    await manager.stop()
    assert sorted(os.listdir(sockdir)) == ["kubelet.sock"]
    assert not manager.registered.is_set()
    await kubelet.wait_for(lambda: all(not v.connected for v in kubelet.plugins.values()), TIMEOUT)
    await kubelet.stop()  # its own server tasks are not the manager's
    assert asyncio.all_tasks() - before == set()


async def test_kubelet_restart_reregisters(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir))
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 2, TIMEOUT)
    await kubelet.restart()  # wipes every socket, ours included, and recreates kubelet.sock
    assert sorted(os.listdir(sockdir)) == ["kubelet.sock"]
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 4, TIMEOUT)
    assert sorted(r.resource_name for r in kubelet.registrations[2:]) == [RDMA, GPU]
    await kubelet.wait_for(lambda: len(_listed(kubelet, RDMA)) == 6, TIMEOUT)
    await kubelet.wait_for(lambda: manager.registrations == 4, TIMEOUT)
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)


async def test_kubelet_sock_replaced_but_plugin_socket_kept(kubelet: LocalKubelet, make_manager,
                                                            sockdir: str) -> None:
    await make_manager(dp_config(sockdir, serve_gpus=False))
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 1, TIMEOUT)
    await kubelet.stop()  # kubelet.sock removed and recreated; our socket stays
    await kubelet.start()
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 2, TIMEOUT)


async def test_own_socket_deleted_is_reserved(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir, serve_gpus=False))
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 1, TIMEOUT)
    os.unlink(os.path.join(sockdir, manager.endpoint(RDMA)))
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 2, TIMEOUT)
    assert os.path.exists(os.path.join(sockdir, manager.endpoint(RDMA)))


async def test_kubelet_absent_at_start_then_appears(make_manager, sockdir: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    manager = await make_manager(dp_config(sockdir), clock=clock)
    for _ in range(6):  # several poll intervals (0.05 s of fake time each) with no kubelet
        await clock.advance(0.05)
        await asyncio.sleep(0.01)
    assert not manager.registered.is_set()
    waiting = [r for r in caplog.records if "waiting for the kubelet" in r.getMessage()]
    assert len(waiting) == 1  # one line per state change, not one per poll
    late = LocalKubelet(sockdir)
    await late.start()
    try:
        await until(lambda: len(late.registrations) == 2, "registration with the late kubelet", TIMEOUT,
                    clock=clock, step=0.05)
        await asyncio.wait_for(manager.registered.wait(), TIMEOUT)
    finally:
        await late.stop()


class RefusingKubelet(LocalKubelet):
    """Fails the first `failures` Register calls, as a kubelet still starting up might."""

    def __init__(self, directory: str, failures: int) -> None:
        super().__init__(directory)
        self.failures = failures
        self.refused = 0

    async def Register(self, request: api_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.Empty:
        if self.refused < self.failures:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not ready")
        return await super().Register(request, context)


async def test_failing_register_retries_with_backoff(make_manager, sockdir: str) -> None:
    kubelet = RefusingKubelet(sockdir, failures=3)
    await kubelet.start()
    try:
        manager = await make_manager(dp_config(sockdir, serve_gpus=False))
        await asyncio.wait_for(manager.registered.wait(), TIMEOUT)
        assert kubelet.refused == 3 and len(kubelet.registrations) == 1
    finally:
        await kubelet.stop()


async def test_kubelet_restart_cuts_a_long_backoff_short(make_manager, sockdir: str) -> None:
    kubelet = RefusingKubelet(sockdir, failures=1)
    await kubelet.start()
    try:
        await make_manager(dp_config(sockdir, serve_gpus=False), backoff_initial=600.0, backoff_max=600.0)
        await kubelet.wait_for(lambda: kubelet.refused == 1, TIMEOUT)  # next try would be in 10 minutes
        await kubelet.restart()
        await kubelet.wait_for(lambda: len(kubelet.registrations) == 1, TIMEOUT)
    finally:
        await kubelet.stop()


async def test_health_events_flip_and_recover(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir))
    await kubelet.wait_for(_both_listed(kubelet), TIMEOUT)
    manager.device_health.apply(DeviceHealthEvent(GPU_UUIDS[1], False, "Xid 79"))
    manager.device_health.apply(DeviceHealthEvent(VFS[2], False, "link down"))
    await kubelet.wait_for(lambda: _listed(kubelet, GPU)[GPU_UUIDS[1]] == "Unhealthy"
                           and _listed(kubelet, RDMA)[VFS[2]] == "Unhealthy", TIMEOUT)
    assert list(_listed(kubelet, GPU).values()).count("Healthy") == 3
    manager.device_health.apply(DeviceHealthEvent(GPU_UUIDS[1], True))
    await kubelet.wait_for(lambda: _listed(kubelet, GPU)[GPU_UUIDS[1]] == "Healthy", TIMEOUT)
    # an Unhealthy device is not admitted
    with pytest.raises(AdmissionError, match="Requested: 6, Available: 5"):
        await kubelet.admit({RDMA: 6})


async def test_topology_update_changes_device_sets(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir), small_topology())
    await kubelet.wait_for(_both_listed(kubelet), TIMEOUT)
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)
    await manager.update_topology(small_topology(vfs_per_pf=5))  # VF count changed
    await kubelet.wait_for(lambda: len(_listed(kubelet, RDMA)) == 10, TIMEOUT)
    manager.device_health.apply(DeviceHealthEvent(VFS[3], False, "down"))
    await manager.update_topology(without_nic(small_topology(vfs_per_pf=5), "0000:1a:00.0"))  # a NIC gone
    await kubelet.wait_for(lambda: len(_listed(kubelet, RDMA)) == 5, TIMEOUT)
    assert all(vf.startswith("0000:9a:") for vf in _listed(kubelet, RDMA))
    assert _listed(kubelet, RDMA)[VFS[3]] == "Unhealthy"  # health survives a rescan
    assert len(kubelet.registrations) == 2  # no re-registration needed for a device-set change


async def test_topology_update_stops_a_resource_left_without_devices(kubelet: LocalKubelet, make_manager,
                                                                     sockdir: str) -> None:
    config = dp_config(sockdir, serve_gpus=False, pools=[
        PoolConfig(resource_name="rdma", selectors=SelectorConfig(is_rdma=True)),
        PoolConfig(resource_name="eth", selectors=SelectorConfig(is_rdma=False))])
    manager = await make_manager(config, small_topology())
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 2, TIMEOUT)
    eth = "gpunodeagent.io/eth"
    assert manager.resources == [eth, "gpunodeagent.io/rdma"]
    eth_socket = os.path.join(sockdir, manager.endpoint(eth))
    assert os.path.exists(eth_socket)
    await kubelet.wait_for(lambda: len(_listed(kubelet, eth)) == 1, TIMEOUT)
    await manager.update_topology(replace(small_topology(), nics=small_topology().nics[:2]))  # Ethernet gone
    await kubelet.wait_for(lambda: not kubelet.plugins[eth].connected, TIMEOUT)  # the kubelet sees it go
    assert _listed(kubelet, eth) == {"0000:c1:00.0": "Unhealthy"}
    assert manager.resources == ["gpunodeagent.io/rdma"]
    assert not os.path.exists(eth_socket)
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)  # still ready: the rest stays registered


async def test_new_resource_on_rescan_registers(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    manager = await make_manager(dp_config(sockdir, serve_gpus=False))
    await kubelet.wait_for(lambda: len(kubelet.registrations) == 1, TIMEOUT)
    manager.config = replace(manager.config, serve_gpus=True)
    await manager.update_topology(small_topology())
    await kubelet.wait_for(lambda: len(_listed(kubelet, GPU)) == 4, TIMEOUT)
    await asyncio.wait_for(manager.registered.wait(), TIMEOUT)


async def test_admit_follows_kubelet_sequence(kubelet: LocalKubelet, make_manager, sockdir: str) -> None:
    await make_manager(dp_config(sockdir))
    await kubelet.wait_for(_both_listed(kubelet), TIMEOUT)
    first = await kubelet.admit({GPU: 2, RDMA: 2}, order=[GPU, RDMA])
    assert len(first[GPU]) == 2 and len(first[RDMA]) == 2
    response = kubelet.responses[RDMA]
    hcas = sorted(response.envs["NCCL_IB_HCA"].lstrip("=").split(","))
    assert len(hcas) == 2 and all(h.endswith(":1") for h in hcas)
    assert kubelet.responses[GPU].envs["NVIDIA_VISIBLE_DEVICES"].split(",") == first[GPU]
    second = await kubelet.admit({RDMA: 4})
    assert set(second[RDMA]).isdisjoint(first[RDMA])
    with pytest.raises(AdmissionError, match="unavailable"):
        await kubelet.admit({RDMA: 1, GPU: 1})
    assert kubelet.allocated[GPU] == set(first[GPU])  # a refused admission keeps nothing
    kubelet.release(second)
    assert len((await kubelet.admit({RDMA: 4}))[RDMA]) == 4
