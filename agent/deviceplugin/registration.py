"""Serve each resource on its unix socket and keep it registered with the kubelet, across kubelet restarts.

The kubelet dials the plugin back while Register is in flight, so every server is started before its Register
call and both run on the same event loop without blocking it. A restarted kubelet deletes every socket in the
directory and recreates `kubelet.sock`; one loop polls both (about every second) and re-serves and
re-registers what is affected. A missing kubelet or a failing Register is logged once per state change and
retried with backoff; nothing here ends the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.clock import SYSTEM_CLOCK, Clock
from agent.deviceplugin.link import LinkLoop
from agent.deviceplugin.server import DevicePlugin
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.host import unixsocket
from agent.host.unixsocket import socket_identity
from agent.supervisor import Backoff

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
DEVICE_PLUGIN_DIR_HINT = "use a shorter device-plugin directory"


def check_socket_path(path: str | os.PathLike[str]) -> str:
    """Return `path` as a string, or raise SocketPathError when it exceeds the 107-byte AF_UNIX limit."""
    return unixsocket.check_socket_path(path, DEVICE_PLUGIN_DIR_HINT)


class PluginServer:
    """One gRPC server for one DevicePlugin servicer on `<directory>/<endpoint>`."""

    def __init__(self, servicer: DevicePlugin, directory: str, endpoint: str,
                 stop_grace: float = 0.5, also_serve: Callable[[grpc.aio.Server], None] | None = None) -> None:
        self.servicer = servicer
        self._also_serve = also_serve  # more services on the same socket (the plugin watcher's Registration)
        self.endpoint = endpoint
        self.path = check_socket_path(Path(directory) / endpoint)
        self._grace = stop_grace
        self._server: grpc.aio.Server | None = None
        self._identity: tuple[int, int] | None = None

    @property
    def serving(self) -> bool:
        """True while our server runs and the socket it bound is still there."""
        return self._server is not None and self._identity is not None \
            and socket_identity(self.path) == self._identity

    async def start(self) -> None:
        """(Re)start serving: any previous server is stopped first, so it cannot unlink the new socket."""
        await self.stop()
        self.servicer.accept_streams()
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        if self._also_serve is not None:
            self._also_serve(server)
        try:
            if server.add_insecure_port(f"unix://{self.path}") == 0:
                raise OSError(f"cannot bind {self.path}")
            await server.start()
        except BaseException:  # cancelled or failed: leave nothing bound behind
            await server.stop(0)
            raise
        self._server = server
        self._identity = socket_identity(self.path)

    async def stop(self) -> None:
        """End open streams and stop the server; its socket file is removed."""
        server, bound = self._server, self._identity
        self._server = self._identity = None
        if server is None:
            return
        self.servicer.end_streams()
        await server.stop(self._grace)
        if bound is not None and socket_identity(self.path) == bound:  # gRPC normally unlinks it already
            with contextlib.suppress(OSError):
                os.unlink(self.path)


async def register(kubelet_socket: str, endpoint: str, resource_name: str, timeout: float) -> None:
    """One Register call; raises grpc.aio.AioRpcError / TimeoutError on failure."""
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        options = api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
        await stub.Register(api_pb2.RegisterRequest(version=API_VERSION, endpoint=endpoint,
                                                    resource_name=resource_name, options=options),
                            timeout=timeout)


@dataclass
class _Entry:
    server: PluginServer
    backoff: Backoff
    registered_with: tuple[int, int] | None = None  # kubelet.sock identity at the last good Register
    next_try: float = 0.0
    last_error: str = ""


class KubeletLink(LinkLoop[_Entry]):
    """Keeps a changing set of plugin servers served and registered with the kubelet in `directory`."""

    task_name = "kubelet-link"

    def __init__(self, directory: str, *, poll_interval: float = 1.0, register_timeout: float = 10.0,
                 backoff_initial: float = 0.5, backoff_max: float = 30.0, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(directory, poll_interval=poll_interval, clock=clock)
        self.kubelet_socket = check_socket_path(Path(directory) / KUBELET_SOCKET)
        self.register_timeout = register_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._kubelet: tuple[int, int] | None = None  # last kubelet.sock seen (kept while it is absent)
        self._present = False
        self._state = ""

    def _entry(self, servicer: DevicePlugin, endpoint: str) -> _Entry:
        return _Entry(PluginServer(servicer, self.directory, endpoint),
                      Backoff(self.backoff_initial, max(self.backoff_initial, self.backoff_max)))

    def _set_state(self, state: str, message: str, *args: object, level: int = logging.INFO) -> None:
        if state != self._state:
            self._state = state
            log.log(level, message, *args)

    def _next_wait(self) -> float:
        if not self._present:
            return self.poll_interval
        now = self.clock.monotonic()
        waits = [e.next_try - now for e in self._entries.values() if e.registered_with != self._kubelet]
        return max(0.0, min([self.poll_interval, *waits]))

    async def step(self) -> None:
        """One pass: check the kubelet, re-serve lost sockets, register what is not registered."""
        kubelet = socket_identity(self.kubelet_socket)
        if kubelet is None:
            self._present = False
            self._set_state("absent", "kubelet socket %s not found; waiting for the kubelet",
                            self.kubelet_socket, level=logging.WARNING)
            self._update_ready()
            return
        self._present = True
        if self._state == "absent":
            self._set_state("present", "kubelet socket %s found; registering", self.kubelet_socket)
        if kubelet != self._kubelet:
            for entry in self._entries.values():  # a new kubelet: retry at once, not after the backoff
                entry.backoff.reset()
                entry.next_try = 0.0
        if self._kubelet is not None and kubelet != self._kubelet:
            log.info("kubelet restarted (%s was replaced); re-serving and re-registering",
                     self.kubelet_socket)
            for entry in self._entries.values():
                entry.registered_with = None
                await entry.server.stop()
        self._kubelet = kubelet
        for name, entry in list(self._entries.items()):
            if self.clock.monotonic() < entry.next_try:
                continue
            if not entry.server.serving:
                if entry.registered_with is not None:
                    log.info("%s: socket %s is gone; re-serving", name, entry.server.path)
                entry.registered_with = None
                try:
                    await entry.server.start()
                except Exception as exc:
                    self._failed(name, entry, f"cannot serve {entry.server.path}: {exc}")
                    continue
            if entry.registered_with != kubelet:
                await self._register(name, entry, kubelet)
        self._update_ready()

    def _failed(self, name: str, entry: _Entry, error: str) -> None:
        entry.next_try = self.clock.monotonic() + entry.backoff.next()
        if error != entry.last_error:
            log.warning("%s: %s; retrying with backoff", name, error)
        entry.last_error = error

    async def _register(self, name: str, entry: _Entry, kubelet: tuple[int, int]) -> None:
        try:
            await register(self.kubelet_socket, entry.server.endpoint, name, self.register_timeout)
        except Exception as exc:  # any failure is retried with backoff; none ends the loop
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            self._failed(name, entry, f"Register with the kubelet failed: {detail}")
            return
        entry.registered_with = kubelet
        entry.backoff.reset()
        entry.next_try, entry.last_error = 0.0, ""
        self.registrations += 1
        log.info("%s: registered with the kubelet (endpoint %s)", name, entry.server.endpoint)

    def _update_ready(self) -> None:
        ready = self._present and all(e.registered_with == self._kubelet and e.server.serving
                                      for e in self._entries.values())
        if ready:
            self._set_state("registered", "all %d device-plugin resources are registered with the kubelet",
                            len(self._entries))
            self.registered.set()
        else:
            if self._state == "registered":
                self._state = "pending"  # quietly: the next "registered" gets its line again
            self.registered.clear()
