"""Local TCP ports for tests that start real servers or point clients at nothing."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (also what a test uses for "the endpoint is down")."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
