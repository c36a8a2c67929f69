"""A stand-in for the kubelet's plugin manager and DRA manager, over the real unix sockets.

It does what the kubelet does (kubernetes/kubelet pkg/kubelet/pluginmanager and cm/dra; `/work/shared/reference/
dra.md` section 3): finds `<name>-reg.sock` in the registry directory, dials it, calls `GetInfo` (1 s timeout),
checks the type is `DRAPlugin`, picks the **first** entry of `supported_versions` it supports, reports the
result with `NotifyRegistrationStatus`, then calls `NodePrepareResources` / `NodeUnprepareResources` of the
chosen version on the endpoint (45 s timeout). `versions` models kubelets of different ages.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from agent.dra.health.v1alpha1 import api_pb2 as health_pb2
from agent.dra.health.v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.v1 import api_pb2 as v1_pb2
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2 as v1beta1_pb2
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc

MODULES = {"v1.DRAPlugin": (v1_pb2, v1_grpc), "v1beta1.DRAPlugin": (v1beta1_pb2, v1beta1_grpc)}


@dataclass
class RegisteredPlugin:
    """A plugin the stand-in accepted: what GetInfo said and the service version it chose."""

    info: reg_pb2.PluginInfo
    version: str
    channel: grpc.aio.Channel

    def _api(self) -> tuple[Any, Any]:
        pb2, grpc_module = MODULES[self.version]
        return pb2, grpc_module.DRAPluginStub(self.channel)

    async def prepare(self, *claims: tuple[str, str, str]) -> Any:
        """NodePrepareResources for (namespace, uid, name) claims."""
        pb2, stub = self._api()
        request = pb2.NodePrepareResourcesRequest(claims=[pb2.Claim(namespace=n, uid=u, name=c) for n, u, c in claims])
        return await stub.NodePrepareResources(request, timeout=45)

    async def unprepare(self, *claims: tuple[str, str, str]) -> Any:
        """NodeUnprepareResources for (namespace, uid, name) claims."""
        pb2, stub = self._api()
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=n, uid=u, name=c) for n, u, c in claims])
        return await stub.NodeUnprepareResources(request, timeout=45)

    async def health_updates(self, count: int) -> list[health_pb2.NodeWatchResourcesResponse]:
        """The first `count` messages of the health stream."""
        assert "v1alpha1.DRAResourceHealth" in self.info.supported_versions
        stream = health_grpc.DRAResourceHealthStub(self.channel).NodeWatchResources(
            health_pb2.NodeWatchResourcesRequest(), timeout=30)
        out = []
        async for message in stream:
            out.append(message)
            if len(out) == count:
                stream.cancel()
                break
        return out


class DraKubelet:
    """Plugin watcher + DRA manager of one kubelet."""

    def __init__(self, registry_dir: Path, versions: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> None:
        self.registry_dir = registry_dir
        self.versions = versions
        self._channels: list[grpc.aio.Channel] = []

    async def register(self, driver: str, timeout: float = 20.0) -> RegisteredPlugin:
        """Wait for the driver's registration socket and register it as the kubelet would."""
        path = self.registry_dir / f"{driver}-reg.sock"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await self._register_once(path)
            except (grpc.aio.AioRpcError, FileNotFoundError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.02)

    async def _register_once(self, path: Path) -> RegisteredPlugin:
        if not path.is_socket():
            raise FileNotFoundError(path)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            registration = reg_grpc.RegistrationStub(channel)
            info = await registration.GetInfo(reg_pb2.InfoRequest(), timeout=1)
            version = next((v for v in info.supported_versions if v in self.versions), None)
            problem = ""
            if info.type != "DRAPlugin":
                problem = f"plugin type {info.type!r} is not DRAPlugin"
            elif version is None:
                problem = f"none of {list(info.supported_versions)} is supported"
            elif not Path(info.endpoint).is_socket():
                problem = f"endpoint {info.endpoint} is not a socket"
            await registration.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=not problem, error=problem), timeout=5)
        if problem or version is None:
            raise AssertionError(f"registration refused: {problem}")
        service = grpc.aio.insecure_channel(f"unix://{info.endpoint}")
        self._channels.append(service)
        return RegisteredPlugin(info, version, service)

    async def close(self) -> None:
        """Close every channel opened to plugins."""
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
