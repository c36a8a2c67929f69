"""`/metrics`, `/healthz` and `/readyz` on one port, served from a thread so a busy event loop cannot hide them.

The server (`agent.http_serve`) bounds connections, request time and size: the port is on the host network.

Liveness asks only "does the event loop still answer" (a heartbeat the loop refreshes); it never depends on the
API server, because an API server brown-out must not restart every agent in a 7,500-node fleet. Readiness
says whether the agent does its job yet: plugins registered, first health pass done.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from agent.config.address import parse_address
from agent.http_serve import BoundedHttpServer, Handler, Limits, Request, Response

log = logging.getLogger(__name__)

def _bind(host: str, port: int) -> list[socket.socket]:
    """Every address: one dual-stack `::` socket, or IPv4 only where the kernel has no IPv6. Else the given one."""
    if host in ("", "::"):
        try:
            return [_socket("::", port, dual_stack=True)]
        except OSError as exc:
            if host == "::":
                raise
            log.info("no IPv6 here (%s); serving on IPv4 only", exc)
            host = "0.0.0.0"  # noqa: S104 - a node agent's metrics are scraped from outside the node
    return [_socket(host, port, dual_stack=False)]


def _socket(host: str, port: int, *, dual_stack: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if dual_stack:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4-mapped connections too
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class Readiness:
    """Named conditions that must all hold before /readyz answers 200; liveness via a loop heartbeat."""

    def __init__(self, liveness_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._conditions: dict[str, bool] = {}
        self._findings = ""  # what the start-up self-check found failing (`gpu-node-agent doctor`'s checks)
        self._lock = threading.Lock()
        self._clock = clock
        self._heartbeat = clock()
        self.liveness_timeout = liveness_timeout

    def require(self, name: str) -> None:
        """Add a condition that starts unmet."""
        with self._lock:
            self._conditions.setdefault(name, False)

    def set(self, name: str, ok: bool = True) -> None:
        """Mark a condition met (or unmet again, e.g. after a kubelet restart)."""
        with self._lock:
            self._conditions[name] = ok

    def findings(self, text: str) -> None:
        """The failing checks of the start-up self-check, named in the detail while not ready ("" for none)."""
        with self._lock:
            self._findings = text

    def beat(self) -> None:
        """Called from the event loop: it is alive."""
        self._heartbeat = self._clock()

    def alive(self) -> tuple[bool, str]:
        """Whether the loop beat recently, with a reason."""
        age = self._clock() - self._heartbeat
        return age <= self.liveness_timeout, f"event loop heartbeat {age:.1f}s ago"

    def ready(self) -> tuple[bool, str]:
        """Whether every condition holds, naming the unmet ones."""
        with self._lock:
            missing = sorted(name for name, ok in self._conditions.items() if not ok)
            findings = self._findings
        if not missing:
            return True, "ready"
        return False, "not ready: " + ", ".join(missing) + (f" (failing check: {findings})" if findings else "")


def make_handler(registry: CollectorRegistry, readiness: Readiness, pool: Executor) -> Handler:
    """The endpoints: /healthz and /readyz answered on the server's loop; any other path is the Prometheus
    exposition, rendered on `pool` so that a slow collector never delays a probe."""
    async def handle(request: Request) -> Response:
        if request.path in ("/healthz", "/readyz"):
            ok, text = readiness.alive() if request.path == "/healthz" else readiness.ready()
            return Response(200 if ok else 503, (text + "\n").encode(),
                            (("Content-Type", "text/plain; charset=utf-8"),))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, _exposition, registry, request.headers.get("accept", ""),
                                          request.headers.get("accept-encoding", ""))

    return handle


def _exposition(registry: CollectorRegistry, accept: str, accept_encoding: str) -> Response:
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry)
    if "gzip" in accept_encoding:
        return Response(200, gzip.compress(body), (("Content-Type", content_type), ("Content-Encoding", "gzip")))
    return Response(200, body, (("Content-Type", content_type),))


class MetricsServer:
    """The HTTP endpoint on its own thread and loop; `port` is the bound port (useful with port 0)."""

    def __init__(self, address: str, registry: CollectorRegistry, readiness: Readiness,
                 limits: Limits | None = None) -> None:
        host, port = parse_address(address)
        sockets = _bind(host, port)
        self.port = sockets[0].getsockname()[1]
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="http-metrics")
        self._server = BoundedHttpServer(sockets, make_handler(registry, readiness, self._pool),
                                         limits or Limits())

    def start(self) -> None:
        """Start serving."""
        self._server.start()
        log.info("serving /metrics, /healthz and /readyz on port %d", self.port)

    def stop(self) -> None:
        """Stop serving and close the socket (also when it never started)."""
        self._server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
