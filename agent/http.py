"""`/metrics`, `/healthz` and `/readyz` on one port, served from a thread so a busy event loop cannot hide them.

Liveness asks only "does the event loop still answer" (a heartbeat the loop refreshes); it never depends on the
API server, because an API server brown-out must not restart every agent in a 7,500-node fleet. Readiness
says whether the agent does its job yet: plugins registered, first health pass done.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from agent.config.address import parse_address

log = logging.getLogger(__name__)

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _DualStackWSGIServer(_ThreadingWSGIServer):
    """Listens on `::` for IPv6 and IPv4 alike, so probes and scrapes work on single- and dual-stack nodes."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        """Accept IPv4-mapped connections too."""
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)


def _bind(host: str, port: int, app: Callable[..., Iterable[bytes]]) -> WSGIServer:
    """Every address: dual-stack `::`, or IPv4 only where the kernel has no IPv6. Else the given address."""
    if host in ("", "::"):
        try:
            return make_server("::", port, app, _DualStackWSGIServer, handler_class=_QuietHandler)
        except OSError as exc:
            if host == "::":
                raise
            log.info("no IPv6 here (%s); serving on IPv4 only", exc)
            host = "0.0.0.0"  # noqa: S104 - a node agent's metrics are scraped from outside the node
    server_class = _DualStackWSGIServer if ":" in host else _ThreadingWSGIServer
    return make_server(host, port, app, server_class, handler_class=_QuietHandler)


class Readiness:
    """Named conditions that must all hold before /readyz answers 200; liveness via a loop heartbeat."""

    def __init__(self, liveness_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._conditions: dict[str, bool] = {}
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
        return not missing, ("not ready: " + ", ".join(missing)) if missing else "ready"


def make_app(registry: CollectorRegistry, readiness: Readiness) -> Callable[..., Iterable[bytes]]:
    """The WSGI application: health endpoints, everything else is Prometheus metrics."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            ok, text = readiness.alive() if path == "/healthz" else readiness.ready()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [(text + "\n").encode()]
        return metrics(environ, start_response)

    return app


class MetricsServer:
    """The HTTP endpoint in a daemon thread; `port` is the bound port (useful with port 0)."""

    def __init__(self, address: str, registry: CollectorRegistry, readiness: Readiness) -> None:
        host, port = parse_address(address)
        self._server = _bind(host, port, make_app(registry, readiness))
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        """Start serving."""
        self._thread.start()
        log.info("serving /metrics, /healthz and /readyz on port %d", self.port)

    def stop(self) -> None:
        """Stop serving and close the socket (never started: only close; `shutdown` would wait forever)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
