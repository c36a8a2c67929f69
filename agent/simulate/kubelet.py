"""A stand-in kubelet for the device-plugin API: tests use it, and `run --simulate` can run against it.

It does what the kubelet's device manager does, as far as a plugin can tell: it serves `v1beta1.Registration`
on `<dir>/kubelet.sock`; on Register it dials the plugin back, reads its options and keeps a ListAndWatch
stream open (the latest full list per resource; a stream that ends marks the devices Unhealthy); it admits
containers with the kubelet's call sequence (GetPreferredAllocation, intersect with what is available, fill
the rest, Allocate); and it restarts the way the kubelet does, deleting every unix socket in the directory.

With `plugins_registry` it also plays the kubelet's plugin watcher (pkg/kubelet/pluginmanager): it notices sockets
that appear in that directory (names starting with `.` and non-sockets are ignored), calls
`pluginregistration.Registration/GetInfo`, validates a `DevicePlugin` answer as the device manager's handler does
(v1beta1 among the versions, an extended resource name), dials `endpoint` and reports the outcome with
`NotifyRegistrationStatus`; a socket that goes away is deregistered. A restart leaves that directory alone and
walks it again, as the kubelet does.

With `pod_resources_socket` it also serves the PodResources v1 API there (`agent.simulate.podresources`) from
the same device records the admissions write: a pod is listed from the start of its admission, each
container's devices appear resource by resource as each Allocate returns (so a plugin's preference call for a
container's second resource sees its first), and a pod's devices go when it ends (`end_pod`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent import aio
from agent.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.host.podresources.simulated import DeviceRecords
from agent.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.simulate.podresources import PodResourcesServer

log = logging.getLogger(__name__)

SUPPORTED_VERSIONS = ("v1beta1",)
WATCH_INTERVAL = 0.05  # the real watcher reacts to inotify events; polling this often is close enough


class AdmissionError(RuntimeError):
    """The stand-in kubelet refused a container, with the kubelet's reason."""


@dataclass(frozen=True)
class KubeletEvent:
    """One thing the stand-in saw: register, devices, disconnected, rejected, allocate, restart."""

    kind: str
    resource: str = ""
    devices: tuple[tuple[str, str], ...] = ()  # (ID, health) for "devices" and "allocate"
    detail: str = ""
    at: float = field(default_factory=time.monotonic)


@dataclass
class PluginView:
    """What the stand-in knows about one registered resource."""

    resource_name: str
    endpoint: str
    options: api_pb2.DevicePluginOptions
    channel: grpc.aio.Channel
    stub: api_pb2_grpc.DevicePluginStub
    devices: dict[str, api_pb2.Device] = field(default_factory=dict)
    lists: int = 0  # ListAndWatch messages received
    connected: bool = True
    task: asyncio.Task[None] | None = None

    def healthy(self) -> set[str]:
        """IDs of the devices last reported Healthy on a live stream."""
        return {i for i, d in self.devices.items() if d.health == "Healthy"} if self.connected else set()

    def health(self) -> dict[str, str]:
        """Device ID -> health as the kubelet sees it (all Unhealthy once the stream ended)."""
        return {i: (d.health if self.connected else "Unhealthy") for i, d in self.devices.items()}


class LocalKubelet(api_pb2_grpc.RegistrationServicer):
    """Registration server plus device-manager behaviour in one directory (keep its path short)."""

    def __init__(self, directory: str | os.PathLike[str], *, rng: random.Random | None = None,
                 dial_timeout: float = 10.0, plugins_registry: str | os.PathLike[str] | None = None,
                 pod_resources_socket: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory)
        self.plugins_registry = Path(plugins_registry) if plugins_registry is not None else None
        self.watched: dict[str, tuple[int, int]] = {}  # registry socket path -> identity it was registered with
        self.statuses: list[tuple[str, bool, str]] = []  # (socket, plugin_registered, error) sent to plugins
        self._watcher: asyncio.Task[None] | None = None
        self.socket_path = str(self.directory / "kubelet.sock")
        self.rng = rng or random.Random()  # noqa: S311 - simulation, not security
        self.dial_timeout = dial_timeout
        self.plugins: dict[str, PluginView] = {}
        self.registrations: list[api_pb2.RegisterRequest] = []
        self.events: list[KubeletEvent] = []
        self.allocated: dict[str, set[str]] = {}  # kept across restarts, like the checkpoint
        self.responses: dict[str, api_pb2.ContainerAllocateResponse] = {}  # latest Allocate reply
        self._server: grpc.aio.Server | None = None
        self._changed = asyncio.Event()
        self._admit_lock = asyncio.Lock()
        self.records = DeviceRecords(self.allocatable)
        self.preferences: list[tuple[str, frozenset[str], tuple[str, ...]]] = []  # (resource, offered, preferred)
        self.pod_resources = (PodResourcesServer(self.records, pod_resources_socket)
                              if pod_resources_socket is not None else None)
        self._pods_admitted = 0

    def allocatable(self) -> dict[str, frozenset[str]]:
        """Resource -> devices the kubelet considers healthy (GetAllocatableResources)."""
        return {name: frozenset(view.healthy()) for name, view in self.plugins.items()}

    def _record(self, event: KubeletEvent) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait until `predicate()` holds, re-checking after every event; TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"condition not met within {timeout} s; last events: {self.events[-5:]}")
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(remaining, 0.1))

    async def start(self) -> None:
        """Serve Registration on kubelet.sock."""
        self.directory.mkdir(parents=True, exist_ok=True)
        server = grpc.aio.server()
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot bind {self.socket_path}")
        await server.start()
        self._server = server
        if self.pod_resources is not None:
            await self.pod_resources.start()
        log.info("stand-in kubelet serving %s", self.socket_path)
        if self.plugins_registry is not None:
            self.plugins_registry.mkdir(parents=True, exist_ok=True)
            self.watched.clear()  # a starting kubelet walks the directory and registers every socket again
            self._watcher = asyncio.create_task(self._watch_registry(), name="kubelet-plugin-watcher")

    async def stop(self) -> None:
        """Stop serving and drop every plugin connection."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
        if self.pod_resources is not None:
            await self.pod_resources.stop()
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await aio.cancel_and_wait(watcher)
        for view in self.plugins.values():
            await self._drop(view)

    async def restart(self) -> None:
        """Simulate a kubelet restart: stop, delete every unix socket in the directory, serve again."""
        await self.stop()
        self.plugins.clear()
        for entry in os.scandir(self.directory):
            if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        self._record(KubeletEvent("restart"))
        await self.start()

    async def _drop(self, view: PluginView) -> None:
        task, view.task = view.task, None
        if task is not None:
            await aio.cancel_and_wait(task)
        await view.channel.close()

    async def Register(self, request: api_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> api_pb2.Empty:
        """Check the request, dial the plugin back, read its options and start watching its devices."""
        name = request.resource_name
        problem = self._problem(name, [request.version])
        if problem:
            self._record(KubeletEvent("rejected", name, detail=problem))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            await self._connect(name, str(self.directory / request.endpoint), request.endpoint)
        except ConnectionError as exc:
            await context.abort(grpc.StatusCode.UNKNOWN, str(exc))
        self.registrations.append(request)
        return api_pb2.Empty()

    @staticmethod
    def _problem(name: str, versions: Iterable[str]) -> str:
        """Why the device manager would refuse this registration, or ""."""
        prefix, _, short = name.rpartition("/")
        if not set(versions) & set(SUPPORTED_VERSIONS):
            return f"unsupported API versions {sorted(versions)}"
        if not prefix or not short or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
            return f"invalid extended resource name {name!r}"
        return ""

    async def _connect(self, name: str, socket: str, endpoint: str, via: str = "kubelet.sock") -> None:
        """Dial a plugin, read its options and watch its devices; ConnectionError when it cannot be reached."""
        channel = grpc.aio.insecure_channel(f"unix://{socket}")
        stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            options = await stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=self.dial_timeout,
                                                        wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            await channel.close()
            self._record(KubeletEvent("rejected", name, detail=f"dial-back failed: {exc.details()}"))
            raise ConnectionError(f"cannot reach plugin {endpoint}: {exc.details()}") from exc
        old = self.plugins.get(name)
        if old is not None:
            await self._drop(old)
        view = PluginView(name, endpoint, options, channel, stub)
        self.plugins[name] = view
        view.task = asyncio.create_task(self._watch(view), name=f"kubelet-watch-{name}")
        self._record(KubeletEvent("register", name, detail=f"{endpoint} via {via}"))
        log.info("stand-in kubelet: %s registered at %s through %s", name, endpoint, via)

    async def _watch_registry(self) -> None:
        assert self.plugins_registry is not None
        names: dict[str, str] = {}  # socket path -> resource name registered through it
        while True:
            present: dict[str, tuple[int, int]] = {}
            for entry in os.scandir(self.plugins_registry):
                info = entry.stat(follow_symlinks=False)
                if not entry.name.startswith(".") and stat.S_ISSOCK(info.st_mode):
                    present[entry.path] = (info.st_ino, info.st_ctime_ns)
            for path in [p for p in self.watched if p not in present]:  # the socket went: DeRegisterPlugin
                del self.watched[path]
                view = self.plugins.pop(names.pop(path, ""), None)
                if view is not None:
                    await self._drop(view)
                    self._record(KubeletEvent("deregister", view.resource_name, detail=path))
            for path, identity in present.items():
                if self.watched.get(path) != identity:
                    self.watched[path] = identity
                    name = await self._register_watched(path)
                    if name:
                        names[path] = name
            await asyncio.sleep(WATCH_INTERVAL)

    async def _register_watched(self, path: str) -> str:
        """GetInfo, validate, connect, NotifyRegistrationStatus; the resource name when registered."""
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = await stub.GetInfo(reg_pb2.InfoRequest(), timeout=1.0, wait_for_ready=True)
            except grpc.aio.AioRpcError as exc:
                self._record(KubeletEvent("rejected", detail=f"{path}: GetInfo failed: {exc.code().name}"))
                return ""
            problem = "" if info.type == "DevicePlugin" else f"plugin type {info.type!r} is not handled here"
            problem = problem or self._problem(info.name, info.supported_versions)
            if not problem:
                try:
                    await self._connect(info.name, info.endpoint or path, info.endpoint or path, via="plugin watcher")
                except ConnectionError as exc:
                    problem = str(exc)
            if problem:
                self._record(KubeletEvent("rejected", info.name, detail=problem))
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.NotifyRegistrationStatus(
                    reg_pb2.RegistrationStatus(plugin_registered=not problem, error=problem), timeout=5.0)
            self.statuses.append((path, not problem, problem))
            return "" if problem else info.name

    async def _watch(self, view: PluginView) -> None:
        detail = "stream ended"
        try:
            async for response in view.stub.ListAndWatch(api_pb2.Empty()):
                view.devices = {device.ID: device for device in response.devices}
                view.lists += 1
                self._record(KubeletEvent("devices", view.resource_name,
                                          tuple((d.ID, d.health) for d in response.devices)))
        except grpc.aio.AioRpcError as exc:
            detail = f"stream failed: {exc.code().name}"
        view.connected = False  # the kubelet marks every device of the resource Unhealthy
        self._record(KubeletEvent("disconnected", view.resource_name, detail=detail))
        log.info("stand-in kubelet: %s disconnected (%s)", view.resource_name, detail)

    def _order(self, requests: Mapping[str, int], order: list[str] | None) -> list[str]:
        if order is None:
            names = list(requests)
            self.rng.shuffle(names)  # the kubelet walks a Go map
            return names
        if sorted(order) != sorted(requests):
            raise ValueError(f"order {order} must name exactly the requested resources {sorted(requests)}")
        return list(order)

    async def admit(self, requests: dict[str, int], order: list[str] | None = None, *,
                    pod: tuple[str, str] | None = None, container: str = "main") -> dict[str, list[str]]:
        """Admit a one-container pod (`pod` = (namespace, name), a fresh name when None): allocate its devices
        resource by resource; returns resource -> device IDs.

        Raises AdmissionError (nothing stays allocated, the pod is not listed) when the kubelet would refuse it.
        """
        done = await self.admit_pod(pod, [(container, requests)], orders={container: order} if order else None)
        return done[container]

    async def admit_pod(self, pod: tuple[str, str] | None, containers: list[tuple[str, dict[str, int]]], *,
                        orders: Mapping[str, list[str]] | None = None) -> dict[str, dict[str, list[str]]]:
        """Admit a pod: listed in PodResources at once, then each container in order, each resource in a random
        order (or `orders[container]`); returns container -> resource -> device IDs."""
        async with self._admit_lock:
            self._pods_admitted += 1
            namespace, name = pod or ("default", f"pod-{self._pods_admitted}")
            self.records.add_pod(namespace, name, [c for c, _ in containers])
            done: dict[str, dict[str, list[str]]] = {}
            try:
                for container, requests in containers:
                    done[container] = got = {}
                    for resource in self._order(requests, (orders or {}).get(container)):
                        if requests[resource] > 0:
                            got[resource] = await self._admit_one(resource, requests[resource])
                            self.records.record(namespace, name, container, resource, got[resource])
            except BaseException:
                self.records.remove_pod(namespace, name)  # a rejected pod is Failed: no longer active
                for got in done.values():
                    self.release(got)
                raise
            return done

    def end_pod(self, namespace: str, name: str) -> None:
        """The pod ended: it is no longer listed and its devices are free again."""
        record = self.records.pods.get((namespace, name))
        if record is None:
            return
        self.records.remove_pod(namespace, name)
        for devices in record.containers.values():
            self.release(devices)

    async def _admit_one(self, name: str, required: int) -> list[str]:
        view = self.plugins.get(name)
        if view is None:
            raise AdmissionError(f"{name}: no device plugin registered")
        taken = self.allocated.setdefault(name, set())
        available = view.healthy() - taken
        if len(available) < required:
            raise AdmissionError(f"requested number of devices unavailable for {name}. "
                                 f"Requested: {required}, Available: {len(available)}")
        chosen: list[str] = []  # no reusable (init-container) devices and no topology hint here

        def fill(candidates: Iterable[str]) -> None:
            pool = [c for c in candidates if c not in chosen]
            self.rng.shuffle(pool)  # the kubelet iterates sets
            chosen.extend(pool[: required - len(chosen)])

        if view.options.get_preferred_allocation_available:
            container = api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=sorted(available | set(chosen)), must_include_deviceIDs=chosen,
                allocation_size=required)
            try:
                reply = await view.stub.GetPreferredAllocation(
                    api_pb2.PreferredAllocationRequest(container_requests=[container]))
            except grpc.aio.AioRpcError as exc:
                raise AdmissionError(
                    f"device plugin GetPreferredAllocation rpc failed: {exc.details()}") from exc
            preferred = set(reply.container_responses[0].deviceIDs) if reply.container_responses else set()
            self.preferences.append((name, frozenset(available | set(chosen)), tuple(preferred)))
            fill(preferred & available)
        fill(available)
        try:
            reply = await view.stub.Allocate(api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)]))
        except grpc.aio.AioRpcError as exc:
            raise AdmissionError(f"{name}: Allocate failed: {exc.code().name}: {exc.details()}") from exc
        if not reply.container_responses:
            raise AdmissionError(f"{name}: Allocate returned no container response")
        taken.update(chosen)
        self.responses[name] = reply.container_responses[0]
        self._record(KubeletEvent("allocate", name, tuple((i, "Healthy") for i in chosen)))
        return chosen

    def release(self, allocation: Mapping[str, Iterable[str]]) -> None:
        """Give devices back (the pod ended); a pod left holding none of its devices is no longer listed."""
        for name, ids in allocation.items():
            self.allocated.get(name, set()).difference_update(ids)
        for key in [k for k, p in self.records.pods.items() if p.containers and not any(
                i in self.allocated.get(r, ()) for c in p.containers.values() for r, ids in c.items() for i in ids)]:
            if any(c for c in self.records.pods[key].containers.values()):
                self.records.remove_pod(*key)
