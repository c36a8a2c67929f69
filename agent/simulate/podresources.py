"""The stand-in kubelet's PodResources v1 server: `DeviceRecords` over a real unix socket, as the kubelet serves it.

Behaviour copied from the kubelet's published code (podresources.md §3): `List` reports active pods, including
one still being admitted, with each container's devices recorded so far, one `ContainerDevices` entry per
device (with its NUMA node when known); `GetAllocatableResources` reports healthy devices, allocated or not;
`Get` finds one pod by name. Every RPC passes a 100 QPS / burst 10 token bucket and fails with
RESOURCE_EXHAUSTED "rejected by rate limit" beyond it. `stop()` removes the socket, as a restarting kubelet does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import grpc

from agent.host.podresources.ratelimit import KUBELET_BURST, KUBELET_QPS, TokenBucket
from agent.host.podresources.simulated import DeviceRecords
from agent.host.podresources.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)


class PodResourcesServer(api_pb2_grpc.PodResourcesListerServicer):
    """Serves `records` on `socket_path`; `numa_of(device_id)` gives a device's NUMA node (None: no topology)."""

    def __init__(self, records: DeviceRecords, socket_path: str | os.PathLike[str], *,
                 numa_of: Callable[[str], int | None] = lambda _id: None) -> None:
        self.records = records
        self.socket_path = str(socket_path)
        self.numa_of = numa_of
        self.bucket = TokenBucket(KUBELET_QPS, KUBELET_BURST)
        self.calls: dict[str, int] = {}
        self.hold: Callable[[], object] | None = None  # tests: an awaitable factory that delays every reply
        self.garbage = False  # tests: answer with names no kubelet would send
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        """Bind the socket (its directory is created) and serve."""
        Path(self.socket_path).parent.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot bind {self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self) -> None:
        """Stop serving and remove the socket."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def _admit_call(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1
        if not self.bucket.take():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rejected by rate limit")
        if self.hold is not None:
            await self.hold()  # type: ignore[misc]

    def _devices(self, resource: str, ids: list[str] | frozenset[str]) -> list[api_pb2.ContainerDevices]:
        out = []
        for device_id in ids:  # one entry per device (per NUMA node), as the kubelet sends them
            numa = self.numa_of(device_id)
            topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)]) if numa is not None else None
            out.append(api_pb2.ContainerDevices(resource_name=resource, device_ids=[device_id], topology=topology))
        return out

    def _pod(self, key: tuple[str, str]) -> api_pb2.PodResources:
        pod = self.records.pods[key]
        containers = []
        for name, devices in pod.containers.items():
            entries = [e for resource, ids in devices.items() for e in self._devices(resource, ids)]
            containers.append(api_pb2.ContainerResources(name=" bad\x00name" if self.garbage else name,
                                                         devices=entries))
        return api_pb2.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    async def List(self, request: api_pb2.ListPodResourcesRequest,  # name fixed by the gRPC service
                   context: grpc.aio.ServicerContext) -> api_pb2.ListPodResourcesResponse:
        """Active pods with the devices recorded so far."""
        await self._admit_call("List", context)
        return api_pb2.ListPodResourcesResponse(pod_resources=[self._pod(k) for k in list(self.records.pods)])

    async def GetAllocatableResources(  # name fixed by the gRPC service
            self, request: api_pb2.AllocatableResourcesRequest,
            context: grpc.aio.ServicerContext) -> api_pb2.AllocatableResourcesResponse:
        """Healthy devices, allocated or not."""
        await self._admit_call("GetAllocatableResources", context)
        healthy = self.records.healthy()
        return api_pb2.AllocatableResourcesResponse(
            devices=[e for resource in sorted(healthy) for e in self._devices(resource, sorted(healthy[resource]))])

    async def Get(self, request: api_pb2.GetPodResourcesRequest,  # name fixed by the gRPC service
                  context: grpc.aio.ServicerContext) -> api_pb2.GetPodResourcesResponse:
        """One pod by namespace and name."""
        await self._admit_call("Get", context)
        key = (request.pod_namespace, request.pod_name)
        if key not in self.records.pods:
            await context.abort(grpc.StatusCode.UNKNOWN,
                                f"pod {request.pod_name} in namespace {request.pod_namespace} not found")
        return api_pb2.GetPodResourcesResponse(pod_resources=self._pod(key))
