"""The dcgm-exporter port: fetch the exporter's Prometheus text over HTTP, or say why not.

`HttpDcgmExporter` is the real client (standard library, no proxies: the exporter runs on this node);
tests and `simulate-dcgm-exporter` serve real exporter text over real HTTP, so the same client is exercised.
Every failure is a `DcgmScrapeError` whose `result` is the `gpu_node_agent_dcgm_scrapes_total{result}` label.
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.error
import urllib.request
from typing import Protocol

MAX_BODY = 16 << 20  # a dcgm-exporter page is tens of KiB; anything near this is not one


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


class HttpDcgmExporter:
    """GET the exporter's /metrics with the standard library, bypassing proxies (it is on this node)."""

    def __init__(self, url: str, timeout: float, max_body: int = MAX_BODY) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"dcgm-exporter URL must be http:// or https://, got {url!r}")
        self.url = url
        self.timeout = timeout
        self.max_body = max_body
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    async def fetch(self) -> str:
        """One scrape in a worker thread (urllib blocks)."""
        return await asyncio.to_thread(self._fetch)

    def _fetch(self) -> str:
        request = urllib.request.Request(self.url, headers={"Accept": "text/plain"})  # noqa: S310 - scheme checked
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                body = response.read(self.max_body + 1)
        except urllib.error.HTTPError as exc:
            raise DcgmScrapeError("http_error", f"HTTP {exc.code} {exc.reason}") from exc
        except TimeoutError as exc:
            raise DcgmScrapeError("timeout", f"no answer within {self.timeout:g} s") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise DcgmScrapeError("timeout", f"no answer within {self.timeout:g} s") from exc
            raise DcgmScrapeError("unreachable", str(exc.reason)) from exc
        except http.client.HTTPException as exc:  # the body ended before its Content-Length or last chunk
            raise DcgmScrapeError("malformed", f"incomplete answer ({type(exc).__name__}: {exc})") from exc
        except (OSError, ValueError) as exc:  # connection reset mid-body, bad URL parts, ...
            raise DcgmScrapeError("unreachable", f"{type(exc).__name__}: {exc}") from exc
        if len(body) > self.max_body:
            raise DcgmScrapeError("too_large", f"answer larger than {self.max_body} bytes")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DcgmScrapeError("malformed", f"not UTF-8 text: {exc}") from exc
