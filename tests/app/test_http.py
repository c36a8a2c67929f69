"""The HTTP endpoint: address parsing, dual-stack binding, and the health/readiness semantics."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from agent.config.address import parse_address
from agent.http import MetricsServer, Readiness


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
