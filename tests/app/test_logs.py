"""Logging setup: the HTTP client's per-request INFO lines stay out of the agent's log."""

from __future__ import annotations

import logging

import httpx2
import pytest
from prometheus_client import CollectorRegistry

from agent.http import MetricsServer, Readiness
from agent.logs import setup_logging


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {name: logging.getLogger(name).level for name in ("httpx2", "httpcore2")}
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


async def test_api_requests_are_not_logged_at_info(capsys, restore_logging) -> None:
    """httpx2 logs `HTTP Request: GET ... "HTTP/1.1 200 OK"` at INFO for every request: one line per API call."""
    setup_logging("info", "text")
    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), Readiness())
    server.start()
    try:
        async with httpx2.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{server.port}/healthz")).status_code == 200
    finally:
        server.stop()
    logging.getLogger("agent.test").info("the agent's own INFO still shows")
    err = capsys.readouterr().err
    assert "HTTP Request" not in err and "the agent's own INFO still shows" in err


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_huge_message_from_outside_is_cut(capsys, restore_logging, fmt: str) -> None:
    """Issue 27: a 1 MiB device name or a 200 KB annotation was copied whole into every log line about it."""
    setup_logging("info", fmt)
    logging.getLogger("agent.test").warning("claim device %s is not on this node", "x" * (1 << 20))
    (line,) = capsys.readouterr().err.splitlines()
    assert len(line) < 9000 and "more characters)" in line
