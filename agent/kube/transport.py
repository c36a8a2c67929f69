"""The HTTP transport of the cluster port: every request the agent sends to the API server is counted here.

`CountingTransport` wraps lightkube's httpx2 transport, so watches, token-refresh retries and paged lists are
all seen, and feeds `gpu_node_agent_apiserver_requests_total{verb,code}` with the Kubernetes verb of the
request (get, list, watch, create, patch, update, delete) and the HTTP status, `timeout` or `error`.
"""

from __future__ import annotations

import httpx2

from agent.kube.metrics import ApiRequestCounter


def request_verb(method: str, path: str, query: str) -> str:
    """Kubernetes verb of an HTTP request: get/list/watch/create/patch/update/delete."""
    if method == "GET":
        if "watch=true" in query or "watch=1" in query:
            return "watch"
        parts = [p for p in path.split("/") if p]
        parts = parts[2:] if parts[:1] == ["api"] else parts[3:]  # drop api/v1 or apis/<group>/<version>
        if parts[:1] == ["namespaces"] and len(parts) > 2:
            parts = parts[2:]
        return "list" if len(parts) <= 1 else "get"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}.get(method, method.lower())


class CountingTransport(httpx2.AsyncBaseTransport):
    """Wraps the real transport and counts every request by verb and status (or `timeout` / `error`)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, counter: ApiRequestCounter) -> None:
        self._inner = inner
        self._counter = counter

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send and count."""
        verb = request_verb(request.method, request.url.path, request.url.query.decode())
        try:
            response = await self._inner.handle_async_request(request)
        except httpx2.TimeoutException:
            self._counter.count(verb, "timeout")
            raise
        except httpx2.HTTPError:
            self._counter.count(verb, "error")
            raise
        self._counter.count(verb, response.status_code)
        return response

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self._inner.aclose()
