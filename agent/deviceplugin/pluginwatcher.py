"""Register device-plugin resources through the kubelet's plugin watcher instead of `kubelet.sock`.

The kubelet watches `/var/lib/kubelet/plugins_registry`; for every socket that appears there it calls
`pluginregistration.Registration/GetInfo`, validates the answer with the handler for its `type` (for
`DevicePlugin`: v1beta1 among `supported_versions`, `name` an extended resource name), dials `endpoint` for the
v1beta1 `DevicePlugin` service and reports the outcome with `NotifyRegistrationStatus`
(kubernetes/kubernetes:pkg/kubelet/pluginmanager, devicemanager/plugin/v1beta1/handler.go). As the SR-IOV and
RDMA shared device plugins do, one socket serves both services and `auto` mode picks the watcher whenever the
directory exists (sriov-network-device-plugin:pkg/utils/utils.go `DetectPluginWatchMode`).

A restarted kubelet deletes the sockets in `device-plugins/`, not in `plugins_registry/`, and walks this
directory at start, so a plugin only has to keep serving; a socket that disappears is served again, and a
`NotifyRegistrationStatus` that reports failure restarts the socket so the watcher sees it anew.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.clock import SYSTEM_CLOCK, Clock
from agent.deviceplugin.link import LinkLoop
from agent.deviceplugin.registration import PluginServer, check_socket_path
from agent.deviceplugin.server import DevicePlugin
from agent.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

AUTO = "auto"
KUBELET_SOCK = "kubelet-sock"
PLUGIN_WATCHER = "plugin-watcher"
MODES = (AUTO, KUBELET_SOCK, PLUGIN_WATCHER)
DEVICE_PLUGIN = "DevicePlugin"
SUPPORTED_VERSIONS = ("v1alpha1", "v1beta1")  # what the SR-IOV and RDMA shared device plugins answer


def resolve_mode(mode: str, registry_dir: str) -> str:
    """`kubelet-sock` or `plugin-watcher`; `auto` is the watcher when its directory exists."""
    if mode not in MODES:
        raise ValueError(f"registration mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == AUTO:
        return PLUGIN_WATCHER if os.path.isdir(registry_dir) else KUBELET_SOCK
    return mode


class RegistrationServicer(reg_grpc.RegistrationServicer):
    """`pluginregistration.Registration` for one resource: who we are, and the kubelet's verdict."""

    def __init__(self, resource_name: str, endpoint: str, on_status: Callable[[], None] = lambda: None) -> None:
        self.resource_name = resource_name
        self.endpoint = endpoint  # the full socket path: the kubelet dials it for the DevicePlugin service
        self.status: bool | None = None  # the kubelet's last verdict since the socket was (re)started
        self.error = ""
        self._on_status = on_status

    async def GetInfo(self, request: reg_pb2.InfoRequest,
                      context: grpc.aio.ServicerContext) -> reg_pb2.PluginInfo:
        """Type DevicePlugin, the resource name and this socket as the endpoint."""
        return reg_pb2.PluginInfo(type=DEVICE_PLUGIN, name=self.resource_name, endpoint=self.endpoint,
                                  supported_versions=list(SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request: reg_pb2.RegistrationStatus,
                                       context: grpc.aio.ServicerContext) -> reg_pb2.RegistrationStatusResponse:
        """Remember the verdict; the link acts on it."""
        self.status, self.error = request.plugin_registered, request.error
        self._on_status()
        return reg_pb2.RegistrationStatusResponse()


@dataclass
class _Entry:
    server: PluginServer
    registration: RegistrationServicer
    last_error: str = ""
    acknowledged: int = 0  # NotifyRegistrationStatus(registered) calls seen since the socket was served


class PluginWatcherLink(LinkLoop[_Entry]):
    """Keeps a changing set of resources served in the plugin-watcher directory (same interface as KubeletLink)."""

    task_name = "plugin-watcher-link"

    def __init__(self, directory: str, *, poll_interval: float = 1.0, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(directory, poll_interval=poll_interval, clock=clock)
        self._ready = False

    def _entry(self, servicer: DevicePlugin, endpoint: str) -> _Entry:
        path = check_socket_path(Path(self.directory) / endpoint)
        registration = RegistrationServicer(servicer.resource_name, path, on_status=self._wake.set)
        server = PluginServer(servicer, self.directory, endpoint,
                              also_serve=lambda s: reg_grpc.add_RegistrationServicer_to_server(registration, s))
        return _Entry(server, registration)

    async def start(self) -> None:
        """Start the serve/watch loop."""
        if self._task is None:
            log.info("registering through the kubelet plugin watcher in %s", self.directory)
        await super().start()

    async def step(self) -> None:
        """One pass: act on the kubelet's verdicts, serve every socket that is not served."""
        for name, entry in self._entries.items():
            registration = entry.registration
            if registration.status is True and entry.acknowledged == 0:
                entry.acknowledged += 1
                self.registrations += 1
                entry.last_error = ""
                log.info("%s: registered with the kubelet through the plugin watcher (%s)", name,
                         entry.server.path)
            elif registration.status is False:
                error = registration.error or "no reason given"
                if error != entry.last_error:
                    log.warning("%s: the kubelet refused the registration: %s; restarting the socket", name, error)
                entry.last_error = error
                await entry.server.stop()  # serving it anew makes the watcher try again
            if not entry.server.serving:
                if entry.acknowledged:
                    log.info("%s: socket %s is gone; serving it again", name, entry.server.path)
                registration.status, entry.acknowledged = None, 0
                try:
                    await entry.server.start()
                except Exception as exc:  # retried at the next pass
                    error = f"cannot serve {entry.server.path}: {exc}"
                    if error != entry.last_error:
                        log.warning("%s: %s; retrying", name, error)
                    entry.last_error = error
        self._update_ready()

    def _update_ready(self) -> None:
        ready = all(e.server.serving and e.acknowledged for e in self._entries.values())
        if ready and not self._ready:
            log.info("all %d device-plugin resources are registered with the kubelet", len(self._entries))
        self._ready = ready
        if ready:
            self.registered.set()
        else:
            self.registered.clear()
