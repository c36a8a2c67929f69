"""A small HTTP/1.1 server for GET endpoints, bounded against every client it cannot trust.

The metrics port listens on the host network on every address, so anything that can reach the node can open
connections to it. The standard library's threading server gave each connection a thread and waited for its
request line for ever: 3,000 idle connections took RSS from 50 to 132 MB and starved `/healthz` for 10 s, which
is how a liveness probe restarts a healthy agent. This server runs its own event loop in one thread (so a busy
main loop still cannot hide the probes) and bounds everything:

- at most `max_connections` open at once; at the limit a new connection pushes out the oldest one that has not
  finished sending its request (an idle or trickling client), so a probe that arrives always gets in;
- the whole request head must arrive within `header_timeout` seconds and fit in `max_request_bytes`;
- only GET and HEAD, no request body; every answer closes the connection;
- a response must be taken within `write_timeout` seconds;
- a listen backlog of `backlog` (the kernel caps it at net.core.somaxconn);
- handlers that may block (rendering /metrics) hand that work to a thread pool, never block this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 512
HEADER_TIMEOUT = 5.0
WRITE_TIMEOUT = 30.0
MAX_REQUEST_BYTES = 8192
BACKLOG = 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            413: "Content Too Large", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


@dataclass(frozen=True)
class Request:
    """What a handler sees: method, path, query string and the headers (names lower-cased)."""

    method: str
    path: str
    query: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    """Status, headers and body of one answer."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Limits:
    """The bounds of one server (tests shrink them)."""

    max_connections: int = MAX_CONNECTIONS
    header_timeout: float = HEADER_TIMEOUT
    write_timeout: float = WRITE_TIMEOUT
    max_request_bytes: int = MAX_REQUEST_BYTES
    backlog: int = BACKLOG


class BoundedHttpServer:
    """Serves `handler` on already-bound listening sockets from a thread of its own."""

    def __init__(self, sockets: list[socket.socket], handler: Handler, limits: Limits = Limits()) -> None:
        self._sockets = sockets
        self._handler = handler
        self.limits = limits
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.Server] = []
        self._reading: OrderedDict[int, asyncio.StreamWriter] = OrderedDict()  # connections still sending
        self._open: set[asyncio.StreamWriter] = set()
        self.pushed_out = 0  # connections closed to make room (the oldest still-sending one)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)

    def start(self) -> None:
        """Start serving; returns once the sockets accept connections."""
        self._thread.start()
        self._started.wait()

    def stop(self) -> None:
        """Close the listeners and every open connection, then end the thread (never started: close the sockets)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        elif not self._started.is_set():
            for sock in self._sockets:
                sock.close()
            self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            for sock in self._sockets:
                sock.listen(self.limits.backlog)
                self._servers.append(self._loop.run_until_complete(asyncio.start_server(
                    self._connection, sock=sock, limit=self.limits.max_request_bytes, backlog=self.limits.backlog)))
        finally:
            self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._open):
            writer.transport.abort()
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        try:
            request = await self._read(reader, writer)
            self._reading.pop(id(writer), None)
            if request is not None:
                response = await self._answer(request)
                await self._write(writer, response, head_only=request.method == "HEAD")
        except (ConnectionError, OSError, TimeoutError):
            pass  # the client went away or would not take the answer: nothing to tell anyone
        finally:
            self._reading.pop(id(writer), None)
            self._open.discard(writer)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        """Count the connection in; at the limit, push out the oldest one still sending its request (False when
        every open connection is busy answering: then the new one is refused)."""
        if len(self._open) >= self.limits.max_connections and not self._reading:
            return False
        if len(self._open) >= self.limits.max_connections:
            _, oldest = self._reading.popitem(last=False)
            oldest.transport.abort()
            self._open.discard(oldest)
            self.pushed_out += 1
            if self.pushed_out & (self.pushed_out - 1) == 0:  # 1st, 2nd, 4th...: a flood is a few log lines
                log.warning("http: %d connections open, the limit; closed the oldest idle one (%d so far)",
                            self.limits.max_connections, self.pushed_out)
        self._open.add(writer)
        self._reading[id(writer)] = writer
        return True

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Request | None:
        try:
            async with asyncio.timeout(self.limits.header_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            await self._write(writer, _text(408, "request head not received in time"))
            return None
        except asyncio.LimitOverrunError:
            await self._write(writer, _text(431, "request head too large"))
            return None
        except asyncio.IncompleteReadError:
            return None
        return self._parse(head)

    def _parse(self, head: bytes) -> Request | None:
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ")
        except ValueError:
            return Request("", "", "", {"x-bad": "request line"})
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        path, _, query = target.partition("?")
        return Request(method, path, query, headers)

    async def _answer(self, request: Request) -> Response:
        if "x-bad" in request.headers:
            return _text(400, "malformed request line")
        if request.method not in ("GET", "HEAD"):
            return _text(405, "only GET and HEAD")
        if request.headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in request.headers:
            return _text(413, "no request body accepted")
        try:
            return await self._handler(request)
        except Exception:
            log.exception("http: handler failed for %s", request.path)
            return _text(500, "internal error")

    async def _write(self, writer: asyncio.StreamWriter, response: Response, *, head_only: bool = False) -> None:
        head = [f"HTTP/1.1 {response.status} {_REASONS.get(response.status, 'Status')}",
                f"Content-Length: {len(response.body)}", "Connection: close",
                *(f"{name}: {value}" for name, value in response.headers)]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(response.body)
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()


def _text(status: int, text: str) -> Response:
    return Response(status, (text + "\n").encode(), (("Content-Type", "text/plain; charset=utf-8"),))
