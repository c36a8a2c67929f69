"""Plugin-watcher registration through the stand-in kubelet: GetInfo, restarts, refusals, lost sockets."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from agent.deviceplugin.manager import DevicePluginManager
from agent.deviceplugin.pluginwatcher import KUBELET_SOCK, PLUGIN_WATCHER, resolve_mode
from agent.deviceplugin.pools import socket_name
from agent.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.simulate.kubelet import LocalKubelet
from tests.deviceplugin.conftest import dp_config

RDMA = "gpunodeagent.io/sriov_rdma"
GPU = "nvidia.com/gpu"
MakeManager = Callable[..., Awaitable[DevicePluginManager]]


def test_schema_matches_the_kubelet_api() -> None:
    """kubernetes/kubelet:pkg/apis/pluginregistration/v1/api.proto, as tabled in dropin.md section 2.4."""
    fdp = descriptor_pb2.FileDescriptorProto()
    reg_pb2.DESCRIPTOR.CopyToProto(fdp)
    assert fdp.package == "pluginregistration"
    (service,) = fdp.service
    assert service.name == "Registration"
    assert {m.name: (m.input_type, m.output_type, m.server_streaming) for m in service.method} == {
        "GetInfo": (".pluginregistration.InfoRequest", ".pluginregistration.PluginInfo", False),
        "NotifyRegistrationStatus": (".pluginregistration.RegistrationStatus",
                                     ".pluginregistration.RegistrationStatusResponse", False),
    }
    fields = {m.name: [(f.number, f.name, f.label == f.LABEL_REPEATED) for f in m.field] for m in fdp.message_type}
    assert fields == {
        "PluginInfo": [(1, "type", False), (2, "name", False), (3, "endpoint", False),
                       (4, "supported_versions", True)],
        "RegistrationStatus": [(1, "plugin_registered", False), (2, "error", False)],
        "RegistrationStatusResponse": [],
        "InfoRequest": [],
    }


def test_auto_mode_follows_the_directory(tmp_path: Path) -> None:
    assert resolve_mode("auto", str(tmp_path / "absent")) == KUBELET_SOCK
    assert resolve_mode("auto", str(tmp_path)) == PLUGIN_WATCHER
    assert resolve_mode("kubelet-sock", str(tmp_path)) == KUBELET_SOCK
    assert resolve_mode("plugin-watcher", str(tmp_path / "absent")) == PLUGIN_WATCHER
    with pytest.raises(ValueError, match="not one of"):
        resolve_mode("both", str(tmp_path))


@pytest.fixture
async def watcher_kubelet(sockdir: str) -> AsyncIterator[LocalKubelet]:
    """A stand-in kubelet that also watches `<sockdir>/plugins_registry`."""
    stand_in = LocalKubelet(sockdir, plugins_registry=Path(sockdir) / "plugins_registry")
    await stand_in.start()
    yield stand_in
    await stand_in.stop()


def _all_listed(kubelet: LocalKubelet, names: tuple[str, ...] = (RDMA, GPU)) -> Callable[[], bool]:
    return lambda: all(n in kubelet.plugins and kubelet.plugins[n].connected and kubelet.plugins[n].lists
                       for n in names)


async def test_auto_mode_registers_through_the_watcher(sockdir: str, watcher_kubelet: LocalKubelet,
                                                       make_manager: MakeManager) -> None:
    manager = await make_manager(dp_config(sockdir))  # the registry directory exists: auto picks the watcher
    assert manager.registration_mode == PLUGIN_WATCHER
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    await watcher_kubelet.wait_for(manager.registered.is_set)
    assert watcher_kubelet.registrations == []  # nothing came through kubelet.sock
    assert manager.registrations == 2
    assert {status for _, status, _ in watcher_kubelet.statuses} == {True}
    socket = Path(sockdir) / "plugins_registry" / socket_name(RDMA)
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        info = await reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=2)
    assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
        "DevicePlugin", RDMA, str(socket), ["v1alpha1", "v1beta1"])
    allocation = await watcher_kubelet.admit({RDMA: 1, GPU: 1})  # Allocate over the same socket
    assert len(allocation[RDMA]) == 1
    assert not any(name.startswith("gna-") for name in os.listdir(sockdir))  # no socket in device-plugins/


async def test_kubelet_restart_re_registers_every_resource(sockdir: str, watcher_kubelet: LocalKubelet,
                                                            make_manager: MakeManager) -> None:
    manager = await make_manager(dp_config(sockdir, registration_mode="plugin-watcher"))
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    before = len(watcher_kubelet.statuses)
    await watcher_kubelet.restart()
    await watcher_kubelet.wait_for(lambda: len(watcher_kubelet.statuses) >= before + 2)
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    assert all(ok for _, ok, _ in watcher_kubelet.statuses)
    assert await watcher_kubelet.admit({GPU: 2})
    assert manager.registered.is_set()


async def test_lost_socket_is_served_again(sockdir: str, watcher_kubelet: LocalKubelet,
                                           make_manager: MakeManager) -> None:
    manager = await make_manager(dp_config(sockdir, registration_mode="plugin-watcher"))
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    await watcher_kubelet.wait_for(manager.registered.is_set)
    os.unlink(Path(sockdir) / "plugins_registry" / socket_name(GPU))
    await watcher_kubelet.wait_for(lambda: any(e.kind == "deregister" for e in watcher_kubelet.events))
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    await watcher_kubelet.wait_for(manager.registered.is_set)
    assert manager.registrations == 3
    assert await watcher_kubelet.admit({GPU: 1})


async def test_refused_registration_restarts_the_socket(sockdir: str, watcher_kubelet: LocalKubelet,
                                                        make_manager: MakeManager) -> None:
    """SR-IOV DP's behaviour: a failed NotifyRegistrationStatus restarts the server, so the watcher retries."""
    manager = await make_manager(dp_config(sockdir, registration_mode="plugin-watcher"))
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    socket = Path(sockdir) / "plugins_registry" / socket_name(RDMA)
    identity = os.lstat(socket).st_ino, os.lstat(socket).st_ctime_ns
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        await reg_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            reg_pb2.RegistrationStatus(plugin_registered=False, error="simulated refusal"), timeout=2)
    await watcher_kubelet.wait_for(lambda: watcher_kubelet.watched.get(str(socket)) not in (None, identity))
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    await watcher_kubelet.wait_for(manager.registered.is_set)
    assert manager.registrations == 3


async def test_kubelet_sock_mode_ignores_the_registry(sockdir: str, watcher_kubelet: LocalKubelet,
                                                      make_manager: MakeManager) -> None:
    manager = await make_manager(dp_config(sockdir, registration_mode="kubelet-sock"))
    assert manager.registration_mode == KUBELET_SOCK
    await watcher_kubelet.wait_for(_all_listed(watcher_kubelet))
    assert {r.resource_name for r in watcher_kubelet.registrations} == {RDMA, GPU}
    assert os.listdir(Path(sockdir) / "plugins_registry") == []
