"""NVSentinel's node-local platform connector: the agent as one of its health monitors.

- `port`: the event values and the port (`send` one batch with a deadline), and `InMemoryConnector`, the simulated
  twin that keeps what it was sent.
- `client`: the real client, gRPC (grpc.aio) over the connector's unix socket, `PlatformConnector.HealthEventOccurredV1`
  (`v1`: stubs generated from proto/nvsentinel/v1/api.proto).
"""

from agent.host.nvsentinel.port import (
    DEFAULT_SOCKET,
    Entity,
    HealthEventData,
    InMemoryConnector,
    NvsentinelError,
    NvsentinelPort,
)

__all__ = ["DEFAULT_SOCKET", "Entity", "HealthEventData", "InMemoryConnector", "NvsentinelError", "NvsentinelPort"]
