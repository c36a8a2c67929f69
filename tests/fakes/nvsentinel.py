"""A stand-in for NVSentinel's platform connector: `PlatformConnector.HealthEventOccurredV1` served with grpc.aio on
a unix socket, as the connector pod serves it to its monitors. It keeps every batch it answered; with `hold` it
sleeps that long in every call first (a connector that hangs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from agent.host.nvsentinel.v1 import api_pb2, api_pb2_grpc


class FakeConnector(api_pb2_grpc.PlatformConnectorServicer):
    """The server side; `events` lists every event of every batch received, in order."""

    def __init__(self, socket_path: Path, hold: float = 0.0) -> None:
        self.socket_path = socket_path
        self.hold = hold
        self.batches: list[api_pb2.HealthEvents] = []
        self.calls = 0
        self._server: grpc.aio.Server | None = None

    @property
    def events(self) -> list[api_pb2.HealthEvent]:
        return [event for batch in self.batches for event in batch.events]

    async def HealthEventOccurredV1(self, request: api_pb2.HealthEvents,
                                    context: grpc.aio.ServicerContext) -> empty_pb2.Empty:
        self.calls += 1
        if self.hold:
            await asyncio.sleep(self.hold)
        self.batches.append(request)
        return empty_pb2.Empty()

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_PlatformConnectorServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=0)
