"""The HTTP endpoint: address parsing, dual-stack binding, and the health/readiness semantics."""

from __future__ import annotations

import gzip
import shutil
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from agent.config.address import parse_address
from agent.http import MetricsServer, Readiness
from agent.http_serve import Limits


@pytest.mark.parametrize(("text", "parsed"), [
    (":9400", ("", 9400)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9400", ("::1", 9400)),
])
def test_addresses(text, parsed):
    assert parse_address(text) == parsed


@pytest.mark.parametrize("text", ["9400", "host:port", ":99999", ""])
def test_bad_addresses_are_named(text):
    with pytest.raises(ValueError, match=repr(text)):
        parse_address(text)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - the test builds http URLs
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def test_every_address_is_served_on_ipv4_and_ipv6_when_the_host_has_both():
    readiness = Readiness()
    server = MetricsServer(":0", CollectorRegistry(), readiness)
    server.start()
    try:
        assert _status(f"http://127.0.0.1:{server.port}/healthz") == 200
        if socket.has_ipv6:
            try:
                assert _status(f"http://[::1]:{server.port}/healthz") == 200
            except urllib.error.URLError:
                pytest.skip("IPv6 loopback not configured on this host")
    finally:
        server.stop()


def test_readiness_names_what_is_missing_and_liveness_follows_the_heartbeat():
    now = [100.0]
    readiness = Readiness(liveness_timeout=30, clock=lambda: now[0])
    readiness.require("device-plugin registered")
    readiness.require("first health pass")
    readiness.set("first health pass")
    assert readiness.ready() == (False, "not ready: device-plugin registered")
    readiness.set("device-plugin registered")
    assert readiness.ready()[0]
    readiness.set("device-plugin registered", False)  # a kubelet restart makes it unready again
    assert not readiness.ready()[0]
    assert readiness.alive()[0]
    now[0] += 31  # the event loop stopped beating
    assert not readiness.alive()[0]
    readiness.beat()
    assert readiness.alive()[0]


# --- bounded against hostile clients (issue 14, item 5): the port is on the host network, on every address ---

def _server(**limits: float) -> MetricsServer:
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), Readiness(), Limits(**limits))  # type: ignore[arg-type]
    server.start()
    return server


def _raw(port: int, data: bytes, *, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_idle_connections_are_bounded_and_a_probe_still_gets_in():
    server = _server(max_connections=50, header_timeout=60.0)
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(200)]
    try:
        assert _status(f"http://127.0.0.1:{server.port}/healthz") == 200
        closed = 0
        for sock in idle:
            sock.settimeout(0.05)  # a connection the server closed has its FIN or RST here already
            try:
                closed += sock.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass  # still held open by the server
        assert closed >= 150  # the server held at most 50 of them open
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_request_head_that_never_ends_is_timed_out():
    server = _server(header_timeout=0.3)
    try:
        assert _raw(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n").startswith(b"HTTP/1.1 408 ")
    finally:
        server.stop()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n", b"431"),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", b"405"),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: 100000000\r\n\r\n", b"413"),
    (b"GARBAGE\r\n\r\n", b"400"),
])
def test_oversized_or_unexpected_requests_are_refused(request_bytes: bytes, status: bytes):
    server = _server()
    try:
        assert _raw(server.port, request_bytes).split(b" ")[1] == status
        assert _status(f"http://127.0.0.1:{server.port}/healthz") == 200  # and the server carries on
    finally:
        server.stop()


def test_the_listen_backlog_is_at_least_128():
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("ss (iproute2) not installed")
    server = _server()
    try:
        out = subprocess.run([ss, "-Hltn", f"sport = :{server.port}"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        send_q = int(out.split()[2])  # for a listening socket, Send-Q is the backlog the kernel granted
        assert send_q >= 128
    finally:
        server.stop()


def test_metrics_are_served_plain_gzip_and_openmetrics():
    registry = CollectorRegistry()
    Counter("gpu_node_agent_test_things", "things", registry=registry).inc()
    server = MetricsServer("127.0.0.1:0", registry, Readiness())
    server.start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert b"gpu_node_agent_test_things_total 1.0" in response.read()
        request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip",
                                                       "Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310
            assert response.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(response.read()).endswith(b"# EOF\n")
    finally:
        server.stop()


def test_readiness_names_the_failing_self_check_while_not_ready():
    readiness = Readiness()
    readiness.require("device-plugin registered")
    readiness.findings("kmsg: cannot read /dev/kmsg: Permission denied")
    assert readiness.ready() == (False, "not ready: device-plugin registered (failing check: kmsg: cannot read "
                                        "/dev/kmsg: Permission denied)")
    readiness.set("device-plugin registered")
    assert readiness.ready() == (True, "ready")
