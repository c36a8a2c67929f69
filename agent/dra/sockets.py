"""Serve the DRA plugin on `dra.sock` and its registration on `<registry>/<driver>-reg.sock`.

The kubelet's plugin watcher sees the registration socket appear, calls `GetInfo`, dials the endpoint it names and
reports back with `NotifyRegistrationStatus`; so the service socket is served first and the registration
socket last. The directory of `dra.sock` must have the same path inside and outside the container
(`/work/shared/reference/dra.md` section 3). A socket deleted under us (a kubelet cleaning its directories, an
operator) is noticed by `ensure()` and served again, which makes the watcher register us again. On stop both
sockets are removed; the ResourceSlices stay (the kubelet deletes them 30 s after the plugin is gone, unless it
comes back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from agent.dra.grpc_api import DraV1, DraV1beta1, Registration, ResourceHealth
from agent.dra.health.v1alpha1 import api_pb2_grpc as health_grpc
from agent.dra.v1 import api_pb2_grpc as v1_grpc
from agent.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from agent.host.unixsocket import check_socket_path, socket_identity
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

DRA_SOCKET = "dra.sock"
class _Served:
    """One grpc.aio server on one unix socket."""

    def __init__(self, path: str, add: Callable[[grpc.aio.Server], None]) -> None:
        self.path = path
        self._add = add
        self._server: grpc.aio.Server | None = None
        self._identity: tuple[int, int] | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None and self._identity is not None and socket_identity(self.path) == self._identity

    async def start(self) -> None:
        await self.stop()
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).unlink(missing_ok=True)
        server = grpc.aio.server()
        self._add(server)
        server.add_insecure_port(f"unix://{self.path}")
        await server.start()
        self._server, self._identity = server, socket_identity(self.path)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=0.5)
        if self._identity is not None and socket_identity(self.path) == self._identity:
            Path(self.path).unlink(missing_ok=True)
        self._identity = None


class PluginSockets:
    """The two sockets of the kubelet DRA plugin."""

    def __init__(self, *, driver: str, plugin_dir: str, registry_dir: str, dra_v1: DraV1, dra_v1beta1: DraV1beta1,
                 health: ResourceHealth, on_status: Callable[[bool, str], None]) -> None:
        self.endpoint = check_socket_path(Path(plugin_dir) / DRA_SOCKET)
        self.registration_path = check_socket_path(Path(registry_dir) / f"{driver}-reg.sock")
        registration = Registration(driver, self.endpoint, on_status)

        def add_services(server: grpc.aio.Server) -> None:
            v1_grpc.add_DRAPluginServicer_to_server(dra_v1, server)
            v1beta1_grpc.add_DRAPluginServicer_to_server(dra_v1beta1, server)
            health_grpc.add_DRAResourceHealthServicer_to_server(health, server)

        self._service = _Served(self.endpoint, add_services)
        self._registration = _Served(self.registration_path,
                                     lambda server: reg_grpc.add_RegistrationServicer_to_server(registration, server))

    async def ensure(self) -> bool:
        """Serve whatever is not served (both when the service socket went); True when something restarted."""
        restarted = False
        if not self._service.serving:
            await self._registration.stop()
            await self._service.start()
            log.info("DRA: serving the kubelet plugin on %s", self.endpoint)
            restarted = True
        if not self._registration.serving:
            await self._registration.start()
            log.info("DRA: registration socket %s is up for the kubelet's plugin watcher", self.registration_path)
            restarted = True
        return restarted

    async def stop(self) -> None:
        """Registration first, so the watcher does not dial a service that is going away."""
        await self._registration.stop()
        await self._service.stop()
