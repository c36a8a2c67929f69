"""The real NVSentinel client: grpc.aio over the platform connector's unix socket, insecure as NVSentinel's own
monitors dial it (the root-owned host directory is the access control).

One channel, opened on first use and kept: gRPC reconnects by path, so a connector pod that restarts and recreates
the socket is picked up. Every call carries the caller's deadline; a connector that hangs costs one deadline per
call and never more, and the caller (`agent.health.nvsentinel`) never waits on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from agent.host.nvsentinel.port import HealthEventData, NvsentinelError
from agent.host.nvsentinel.v1 import api_pb2, api_pb2_grpc

EVENT_VERSION = 1  # the version NVSentinel's monitors stamp on the batch and on each event

_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.INVALID_ARGUMENT: "refused",
    grpc.StatusCode.UNIMPLEMENTED: "refused",
    grpc.StatusCode.PERMISSION_DENIED: "refused",
}


def to_message(event: HealthEventData) -> api_pb2.HealthEvent:
    """The protobuf HealthEvent of one event."""
    stamp = Timestamp()
    stamp.FromNanoseconds(int(event.generated_at * 1e9))
    return api_pb2.HealthEvent(
        version=EVENT_VERSION, agent=event.agent, componentClass=event.component_class,
        checkName=event.check_name, isFatal=event.is_fatal, isHealthy=event.is_healthy, message=event.message,
        recommendedAction=event.recommended_action,
        errorCode=list(event.error_codes),
        entitiesImpacted=[api_pb2.Entity(entityType=e.kind, entityValue=e.value) for e in event.entities],
        metadata=dict(event.metadata), generatedTimestamp=stamp, nodeName=event.node_name,
        processingStrategy=event.processing_strategy)


class GrpcConnector:
    """`NvsentinelPort` over the connector's socket."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.PlatformConnectorStub | None = None

    def _connect(self) -> api_pb2_grpc.PlatformConnectorStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket_path}")
            self._stub = api_pb2_grpc.PlatformConnectorStub(self._channel)
        return self._stub

    async def send(self, events: Sequence[HealthEventData], timeout: float) -> None:
        """One HealthEventOccurredV1 call; NvsentinelError when it failed or passed its deadline."""
        batch = api_pb2.HealthEvents(version=EVENT_VERSION, events=[to_message(e) for e in events])
        try:
            await self._connect().HealthEventOccurredV1(batch, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise NvsentinelError(_REASONS.get(exc.code(), "error"),
                                  f"{exc.code().name}: {(exc.details() or '')[:200]}") from exc

    async def aclose(self) -> None:
        """Close the channel."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None
