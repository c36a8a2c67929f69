"""A stand-in device plugin for another vendor's resource (NVIDIA's GPU plugin): UUID device IDs, its own picks.

It serves `v1beta1.DevicePlugin` on a unix socket in the kubelet's directory and registers like any plugin, so
the stand-in kubelet admits its resource with the real call sequence. Its preference is its own (the lowest
IDs, or a seeded random pick, as NVIDIA's plugin knows nothing of NICs); `during_preference` lets a test run
code inside the kubelet's preference call, when PodResources shows the container's earlier resources.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc


class StandInPlugin(api_pb2_grpc.DevicePluginServicer):
    """One resource of fixed devices; `rng` None picks the lowest IDs."""

    def __init__(self, directory: str | Path, resource: str, device_ids: Sequence[str], *,
                 rng: random.Random | None = None,
                 during_preference: Callable[[Sequence[str]], Awaitable[None]] | None = None) -> None:
        self.directory = Path(directory)
        self.resource = resource
        self.device_ids = list(device_ids)
        self.rng = rng
        self.during_preference = during_preference
        self.endpoint = f"standin-{resource.replace('/', '_').replace('.', '_')}.sock"
        self.allocations: list[list[str]] = []
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Serve and register with the kubelet in `directory`."""
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.directory / self.endpoint}")
        await server.start()
        self._server = server
        async with grpc.aio.insecure_channel(f"unix://{self.directory / 'kubelet.sock'}") as channel:
            await api_pb2_grpc.RegistrationStub(channel).Register(api_pb2.RegisterRequest(
                version="v1beta1", endpoint=self.endpoint, resource_name=self.resource,
                options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)), timeout=10)

    async def stop(self) -> None:
        """Stop serving (the kubelet marks the devices Unhealthy)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)

    async def GetDevicePluginOptions(self, request: api_pb2.Empty,  # name fixed by the gRPC service
                                     context: grpc.aio.ServicerContext) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: api_pb2.Empty,  # name fixed by the gRPC service
                           context: grpc.aio.ServicerContext) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        yield api_pb2.ListAndWatchResponse(devices=[api_pb2.Device(ID=i, health="Healthy") for i in self.device_ids])
        await asyncio.Event().wait()  # keep the stream open until the server stops (cancels this handler)

    async def GetPreferredAllocation(  # name fixed by the gRPC service
            self, request: api_pb2.PreferredAllocationRequest,
            context: grpc.aio.ServicerContext) -> api_pb2.PreferredAllocationResponse:
        responses = []
        for container in request.container_requests:
            if self.during_preference is not None:
                await self.during_preference(list(container.available_deviceIDs))
            must = list(container.must_include_deviceIDs)
            rest = sorted(set(container.available_deviceIDs) - set(must))
            if self.rng is not None:
                self.rng.shuffle(rest)
            responses.append(api_pb2.ContainerPreferredAllocationResponse(
                deviceIDs=(must + rest)[: container.allocation_size]))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    async def Allocate(self, request: api_pb2.AllocateRequest,  # name fixed by the gRPC service
                       context: grpc.aio.ServicerContext) -> api_pb2.AllocateResponse:
        for container in request.container_requests:
            self.allocations.append(list(container.devices_ids))
        return api_pb2.AllocateResponse(container_responses=[
            api_pb2.ContainerAllocateResponse(envs={"NVIDIA_VISIBLE_DEVICES": ",".join(c.devices_ids)})
            for c in request.container_requests])
