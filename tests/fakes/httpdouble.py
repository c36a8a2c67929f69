"""The HTTP/1.1 plumbing of the API double: a real socket server on 127.0.0.1, request recording, faults.

Plain asyncio streams, no dependency: keep-alive, Content-Length bodies, and chunked responses for watches.
Subclasses answer requests (`_answer`) and serve watches (`_watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.clock import FakeClock

Answer = tuple[int, Any, dict[str, str]]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: Any
    content_type: str
    at: float

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int = 1
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    json_body: bool = True


def status_body(code: int, message: str, reason: str = "") -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


_REASONS = {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict", 410: "Gone", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable", 400: "Bad Request"}


class HttpDouble:
    """Records every request; scripted faults first, then the subclass answers."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.inflight = 0
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._closing()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def _closing(self) -> None:
        """Hook: wake long-running responses (watches) so the server can close."""

    def fail(self, method: str, path: str, status: int, *, times: int = 1, delay: float = 0.0,
             headers: dict[str, str] | None = None, json_body: bool = True) -> None:
        """The next `times` requests matching method and path regex get `status` (after `delay` real seconds)."""
        self.faults.append(Fault(method, re.compile(path), status, times, delay, headers or {}, json_body))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = raw.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                data = await reader.readexactly(int(headers.get("content-length", "0")))
                split = urllib.parse.urlsplit(target)
                query = dict(urllib.parse.parse_qsl(split.query))
                request = Request(method, split.path, query, json.loads(data) if data else None,
                                  headers.get("content-type", ""), self.clock.now())
                self.requests.append(request)
                if request.watch:
                    await self._watch(request, writer)
                    continue
                self.inflight += 1
                try:
                    status, body, extra = await self._answer(request)
                finally:
                    self.inflight -= 1
                await self._respond(writer, status, body, extra)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _respond(self, writer: asyncio.StreamWriter, status: int, body: Any,
                       extra: dict[str, str] | None = None) -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        kind = "application/json" if not isinstance(body, bytes) else "text/plain"
        head = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", f"Content-Type: {kind}",
                f"Content-Length: {len(payload)}"] + [f"{k}: {v}" for k, v in (extra or {}).items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()

    async def _fault(self, request: Request) -> Answer | None:
        for fault in self.faults:
            if fault.times > 0 and fault.method == request.method and fault.path.search(request.path):
                fault.times -= 1
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                body = status_body(fault.status, f"injected {fault.status}") if fault.json_body else b"injected"
                return fault.status, body, fault.headers
        return None

    async def send_chunk(self, writer: asyncio.StreamWriter, obj: Any) -> None:
        """One JSON line as one chunk of a chunked response."""
        line = json.dumps(obj).encode() + b"\n"
        writer.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        await writer.drain()

    async def _answer(self, r: Request) -> Answer:
        raise NotImplementedError

    async def _watch(self, r: Request, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
