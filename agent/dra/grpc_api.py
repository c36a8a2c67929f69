"""The gRPC faces of the DRA driver: DRAPlugin v1 and v1beta1, DRAResourceHealth v1alpha1, plugin registration.

They only translate: requests to `ClaimRef`s for the `ClaimPreparer`, outcomes to the version's messages. Every
claim in a request gets an entry in the response (the kubelet retries missing ones); a per-claim failure is that
entry's `error`, never a gRPC error, which would make the kubelet ignore the whole answer
(`/work/shared/reference/dra.md` section 2). Registration answers `GetInfo` with type `DRAPlugin`, the driver
name, the dra.sock path and the services in preference order (the kubelet takes the first it supports).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from agent.dra.claims import ClaimRef
from agent.dra.health.v1alpha1 import api_pb2 as health_pb2
from agent.dra.health.v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.prepare import ClaimPreparer, Outcome
from agent.dra.v1 import api_pb2 as v1_pb2
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2 as v1beta1_pb2
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.logs import cut
from agent.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

ERROR_MAX = 4096  # a claim's error as the kubelet shows it: names from outside can be any size

PLUGIN_TYPE = "DRAPlugin"
SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")


def _refs(claims: Sequence[Any]) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.uid, c.name) for c in claims]


def _devices(pb2: Any, outcome: Outcome) -> list[Any]:
    return [pb2.Device(request_names=list(d.requests), pool_name=d.pool, device_name=d.device,
                       cdi_device_ids=list(d.cdi_ids)) for d in outcome.devices]


class _DraServicer:
    """NodePrepareResources / NodeUnprepareResources for one protobuf module (v1 and v1beta1 share messages)."""

    pb2: Any

    def __init__(self, preparer: ClaimPreparer) -> None:
        self._preparer = preparer

    async def NodePrepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outcomes = await self._preparer.prepare(_refs(request.claims))
        return self.pb2.NodePrepareResourcesResponse(claims={
            uid: self.pb2.NodePrepareResourceResponse(devices=_devices(self.pb2, o), error=cut(o.error, ERROR_MAX))
            for uid, o in outcomes.items()})

    async def NodeUnprepareResources(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        outcomes = await self._preparer.unprepare(_refs(request.claims))
        return self.pb2.NodeUnprepareResourcesResponse(claims={
            uid: self.pb2.NodeUnprepareResourceResponse(error=cut(o.error, ERROR_MAX)) for uid, o in outcomes.items()})


class DraV1(_DraServicer, v1_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin."""

    pb2 = v1_pb2


class DraV1beta1(_DraServicer, v1beta1_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin (deprecated since 1.34, still served by kubelets)."""

    pb2 = v1beta1_pb2


class HealthBook:
    """Every device's health as the kubelet's health stream wants it: the complete list on each change."""

    def __init__(self) -> None:
        self._devices: dict[tuple[str, str], tuple[bool, str]] = {}  # (pool, device) -> (healthy, message)
        self._changed = asyncio.Condition()
        self.version = 0

    async def set(self, devices: dict[tuple[str, str], tuple[bool, str]]) -> None:
        """Replace the list; wakes the streams when it differs."""
        if devices == self._devices:
            return
        self._devices = dict(devices)
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    def response(self, now: Callable[[], float] = time.time) -> health_pb2.NodeWatchResourcesResponse:
        """The complete list."""
        stamp = int(now())
        return health_pb2.NodeWatchResourcesResponse(devices=[health_pb2.DeviceHealth(
            device=health_pb2.DeviceIdentifier(pool_name=pool, device_name=name),
            health=health_pb2.HEALTHY if healthy else health_pb2.UNHEALTHY, last_updated_time=stamp,
            message=message[:1024]) for (pool, name), (healthy, message) in sorted(self._devices.items())])

    async def wait_change(self, seen: int) -> int:
        """Block until the version passes `seen`; the new version."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen)
            return self.version


class ResourceHealth(health_grpc.DRAResourceHealthServicer):
    """v1alpha1.DRAResourceHealth/NodeWatchResources: the list at once, then on every change."""

    def __init__(self, book: HealthBook) -> None:
        self._book = book

    async def NodeWatchResources(self, request: health_pb2.NodeWatchResourcesRequest,
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[
                                     health_pb2.NodeWatchResourcesResponse]:
        seen = self._book.version
        yield self._book.response()
        while True:
            seen = await self._book.wait_change(seen)
            yield self._book.response()


class Registration(reg_grpc.RegistrationServicer):
    """pluginregistration.Registration for the plugin watcher."""

    def __init__(self, driver: str, endpoint: str, on_status: Callable[[bool, str], None]) -> None:
        self._driver = driver
        self._endpoint = endpoint
        self._on_status = on_status

    async def GetInfo(self, request: reg_pb2.InfoRequest,
                      context: grpc.aio.ServicerContext) -> reg_pb2.PluginInfo:
        return reg_pb2.PluginInfo(type=PLUGIN_TYPE, name=self._driver, endpoint=self._endpoint,
                                  supported_versions=list(SERVICES))

    async def NotifyRegistrationStatus(self, request: reg_pb2.RegistrationStatus,
                                       context: grpc.aio.ServicerContext) -> reg_pb2.RegistrationStatusResponse:
        self._on_status(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()
