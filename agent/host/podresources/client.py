"""The real PodResources client: gRPC (grpc.aio) over the kubelet's unix socket.

One channel, opened on first use and kept (gRPC reconnects by path, so a kubelet restart that recreates the
socket in the mounted directory is picked up without help). Every call carries its own short deadline and
takes a token from the client-side bucket first (`ratelimit`): a background call waits for one; a preference-path
call waits only while one comes within `token_wait` (a burst of admissions is paced at the agent's share of the
kubelet's limit, never pushed past it) and otherwise fails at once as `rate_limited`. Replies are checked before
they are believed: a device ID or name that is empty, absurdly long or not printable is `invalid`, as is a reply
over 16 MiB.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

import grpc

from agent.host.podresources.port import ContainerDevices, PodResourcesError, Reachability
from agent.host.podresources.ratelimit import TokenBucket
from agent.host.podresources.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_MESSAGE = 16 * 1024 * 1024  # what Multus allows for large nodes (podresources.md §1)
MAX_ID = 253  # longest device ID or object name believed (a DNS subdomain; bus ids and UUIDs are far shorter)
DEFAULT_TIMEOUT = 2.0
TOKEN_WAIT_S = 0.05  # one token at the default 50/s is 20 ms away at most; 50 ms is two and a half

_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limited",
    grpc.StatusCode.INTERNAL: "invalid",  # includes replies that do not decode
    grpc.StatusCode.UNIMPLEMENTED: "invalid",
}


def _checked(text: str, what: str) -> str:
    if not text or len(text) > MAX_ID or not text.isprintable() or text.strip() != text:
        raise PodResourcesError("invalid", f"{what} {text[:40]!r} is not a usable name")
    return text


def group_devices(entries: Iterable[api_pb2.ContainerDevices]) -> dict[str, frozenset[str]]:
    """resource -> device IDs, merging the kubelet's one-entry-per-device-per-NUMA-node form."""
    grouped: dict[str, set[str]] = {}
    for entry in entries:
        resource = _checked(entry.resource_name, "resource name")
        grouped.setdefault(resource, set()).update(_checked(i, f"{resource} device ID") for i in entry.device_ids)
    return {resource: frozenset(ids) for resource, ids in grouped.items()}


def containers_of(reply: api_pb2.ListPodResourcesResponse) -> tuple[ContainerDevices, ...]:
    """The listed containers as plain values; `PodResourcesError('invalid')` for nonsense."""
    out: list[ContainerDevices] = []
    for pod in reply.pod_resources:
        namespace, name = _checked(pod.namespace, "pod namespace"), _checked(pod.name, "pod name")
        for container in pod.containers:
            out.append(ContainerDevices(namespace, name, _checked(container.name, "container name"),
                                        group_devices(container.devices)))
    return tuple(out)


class KubeletPodResources:
    """`PodResourcesPort` over `unix://<socket>`; `reachability` hears of every call's outcome."""

    def __init__(self, socket_path: str, *, bucket: TokenBucket | None = None,
                 reachability: Reachability | None = None, timeout: float = DEFAULT_TIMEOUT,
                 token_wait: float = TOKEN_WAIT_S) -> None:
        self.socket_path = socket_path
        self.token_wait = token_wait
        self.bucket = bucket or TokenBucket()
        self.reachability = reachability
        self.timeout = timeout
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None

    def _connect(self) -> api_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                f"unix://{self.socket_path}",
                options=[("grpc.max_receive_message_length", MAX_MESSAGE),
                         # fail fast while the kubelet restarts instead of waiting for a reconnect backoff
                         ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)])
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def list(self, timeout: float | None = None, *, patient: bool = False) -> tuple[ContainerDevices, ...]:
        """`List` with a deadline of `timeout` (the client's default when None)."""
        reply = await self._call("List", api_pb2.ListPodResourcesRequest(), timeout, patient)
        assert isinstance(reply, api_pb2.ListPodResourcesResponse)
        return self._believe(lambda: containers_of(reply))

    async def allocatable(self, timeout: float | None = None, *,
                          patient: bool = False) -> Mapping[str, frozenset[str]]:
        """`GetAllocatableResources` with a deadline."""
        reply = await self._call("GetAllocatableResources", api_pb2.AllocatableResourcesRequest(), timeout, patient)
        assert isinstance(reply, api_pb2.AllocatableResourcesResponse)
        return self._believe(lambda: group_devices(reply.devices))

    def _believe(self, decode: Callable[[], T]) -> T:
        try:
            value = decode()
        except PodResourcesError as exc:
            self._failed(exc)
            raise
        if self.reachability is not None:
            self.reachability.succeeded()
        return value

    def _failed(self, error: PodResourcesError) -> None:
        if self.reachability is not None:
            self.reachability.failed(error)

    async def _call(self, method: str, request: object, timeout: float | None, patient: bool) -> object:
        if not os.path.exists(self.socket_path):
            error = PodResourcesError("unavailable", f"no socket at {self.socket_path}")
            self._failed(error)
            raise error
        if patient:
            await self.bucket.wait()
        elif not await self.bucket.take_within(self.token_wait):
            raise PodResourcesError("rate_limited", "the agent's share of the kubelet's rate limit is used up")
        stub = self._connect()
        rpc = getattr(stub, method)
        try:
            return await rpc(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.aio.AioRpcError as exc:
            error = PodResourcesError(_REASONS.get(exc.code(), "unavailable"),
                                      f"{method}: {exc.code().name}: {exc.details()}")
        self._failed(error)
        raise error

    async def aclose(self) -> None:
        """Close the channel (a later call opens a new one)."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()
