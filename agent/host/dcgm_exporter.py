"""The dcgm-exporter port: fetch the exporter's Prometheus text over HTTP, or say why not.

`HttpDcgmExporter` is the real client (asyncio HTTP, no proxies: the exporter runs on this node);
tests and `simulate-dcgm-exporter` serve real exporter text over real HTTP, so the same client is exercised.
Every failure is a `DcgmScrapeError` whose `result` is the `gpu_node_agent_dcgm_scrapes_total{result}` label.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import httpx2

log = logging.getLogger(__name__)

MAX_BODY = 16 << 20  # a dcgm-exporter page is tens of KiB; anything near this is not one
MAX_KEPT = 2 << 20  # kept lines: an 8-GPU page with 7 MIG instances each and a dozen Xid codes keeps ~0.6 MiB
MAX_LINE = 64 << 10  # one line of a page; a body without newlines is not Prometheus text


class DcgmScrapeError(Exception):
    """One scrape failed; `result` is the metric label (unreachable, timeout, http_error, too_large, malformed)."""

    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result


class DcgmExporterPort(Protocol):
    """Where dcgm-exporter's text comes from."""

    url: str

    async def fetch(self) -> str:
        """The exporter's current /metrics text; DcgmScrapeError when it cannot be had."""

    async def aclose(self) -> None:
        """Release connections."""


class HttpDcgmExporter:
    """GET the exporter's /metrics on the event loop, bypassing proxies (it is on this node).

    One overall deadline covers the whole exchange: connect, headers and every byte of the body. A peer that
    trickles a byte a second used to hold a worker thread (and shutdown) for as long as it liked, because a
    socket timeout only bounds the wait for the next byte. The body is read as a stream and split into lines as
    it comes; only lines `keep` accepts are held (the agent reads a few families of a page that is mostly clocks,
    power and utilisation, and only this node's GPUs' samples), so a page of many megabytes costs its bytes in
    passing, not in memory. What is kept is capped too (`max_kept` bytes, and no line over MAX_LINE is buffered):
    past it the scrape is `too_large`, so memory stays bounded whatever the page holds (issue 27).

    One client serves every scrape (kept-alive connection): building a client loads the TLS certificate store,
    ~21 ms of CPU, which a per-scrape client paid every time even for a plain-http loopback URL (issue 32: the
    scrape went from 5 to 31-35 ms). A plain-http URL gets a client with no certificate store at all. A failed
    exchange drops the client, so the next scrape starts from a fresh connection."""

    def __init__(self, url: str, timeout: float, max_body: int = MAX_BODY,
                 keep: Callable[[str], bool] = lambda line: True, max_kept: int = MAX_KEPT) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"dcgm-exporter URL must be http:// or https://, got {url!r}")
        self.url = url
        self.timeout = timeout
        self.max_body = max_body
        self.keep = keep
        self.max_kept = max_kept
        self._client: httpx2.AsyncClient | None = None

    def _session(self) -> httpx2.AsyncClient:
        if self._client is None:
            # http:// needs no certificate store; https:// loads it once, here, not per scrape
            verify = self.url.startswith("https://")
            self._client = httpx2.AsyncClient(trust_env=False, timeout=self.timeout, follow_redirects=False,
                                              verify=verify)
        return self._client

    async def aclose(self) -> None:
        """Close the kept-alive connection (the agent stopping)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def fetch(self) -> str:
        """One scrape, whole within `timeout` seconds (cancelling it, e.g. at shutdown, ends it at once)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._fetch()
        except TimeoutError as exc:
            await self._drop()
            raise DcgmScrapeError("timeout", f"no complete answer within {self.timeout:g} s") from exc
        except DcgmScrapeError:
            await self._drop()  # a half-read or refused exchange: no connection of it is reused
            raise
        except asyncio.CancelledError:
            await asyncio.shield(self._drop())
            raise

    async def _drop(self) -> None:
        try:
            await self.aclose()
        except Exception as exc:  # closing a broken connection can fail; the client is dropped anyway
            log.debug("closing the dcgm-exporter connection: %s", exc)

    async def _fetch(self) -> str:
        lines = _Lines(self.keep, self.max_body, self.max_kept)
        try:
            async with self._session().stream("GET", self.url, headers={"Accept": "text/plain"}) as response:
                if response.status_code >= 400:
                    raise DcgmScrapeError("http_error", f"HTTP {response.status_code} {response.reason_phrase}")
                async for chunk in response.aiter_bytes():
                    lines.feed(chunk)
        except httpx2.TimeoutException as exc:
            raise DcgmScrapeError("timeout", f"no answer within {self.timeout:g} s") from exc
        except httpx2.RemoteProtocolError as exc:  # the body ended before its Content-Length or last chunk
            raise DcgmScrapeError("malformed", f"incomplete answer ({type(exc).__name__}: {exc})") from exc
        except (httpx2.HTTPError, OSError, ValueError) as exc:  # refused, reset mid-body, bad URL parts, ...
            raise DcgmScrapeError("unreachable", f"{type(exc).__name__}: {exc}") from exc
        return lines.text()


class _Lines:
    """Split a streamed body into lines, keep the wanted ones, count every byte and every kept byte against the
    limits."""

    def __init__(self, keep: Callable[[str], bool], max_body: int, max_kept: int = MAX_KEPT) -> None:
        self._keep = keep
        self._max = max_body
        self._max_kept = max_kept
        self._kept_size = 0
        self._size = 0
        self._pending = b""
        self._kept: list[str] = []

    def feed(self, chunk: bytes) -> None:
        self._size += len(chunk)
        if self._size > self._max:
            raise DcgmScrapeError("too_large", f"answer larger than {self._max} bytes")
        *whole, self._pending = (self._pending + chunk).split(b"\n")
        for raw in whole:
            self._line(raw)
        if len(self._pending) > MAX_LINE:
            raise DcgmScrapeError("malformed", f"a line longer than {MAX_LINE} bytes: not Prometheus text")

    def _line(self, raw: bytes) -> None:
        try:
            line = raw.rstrip(b"\r").decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DcgmScrapeError("malformed", f"not UTF-8 text: {exc}") from exc
        if self._keep(line):
            self._kept_size += len(line) + 1
            if self._kept_size > self._max_kept:
                raise DcgmScrapeError("too_large", f"more than {self._max_kept} bytes of lines the agent reads "
                                      f"(the metrics it reads, of this node's GPUs)")
            self._kept.append(line)

    def text(self) -> str:
        """The kept lines. A body whose last line has no newline was cut short, whether or not that line would
        have been kept: malformed (Prometheus text ends every line, the last one too)."""
        if self._pending:
            raise DcgmScrapeError("malformed", "not Prometheus text (the answer ends mid-line: cut short)")
        return "".join(line + "\n" for line in self._kept)
