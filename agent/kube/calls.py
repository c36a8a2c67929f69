"""The lightkube boundary the real port's modules share: the client from credentials, error translation, the
streamed requests lightkube's public API cannot make, and `Calls`, the base of the port's request groups.

Every failure (lightkube `ApiError`, httpx status errors, timeouts, connection errors, undecodable bodies) leaves
as an `agent.kube.errors.Api*` exception with `raise ... from`. Watches and size-bounded LISTs are one request per
call built with lightkube's request builder (`_client.prepare_request`), hence the pinned lightkube minor version:
its `watch()` cannot ask for bookmarks and reconnects on its own, which would hide requests from the caller's
backoff, and its `list()` decodes a whole answer on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, TypeVar

import httpx2
import msgspec
from lightkube import AsyncClient, KubeConfig
from lightkube.config.client_adapter import verify_cluster
from lightkube.core.exceptions import ApiError as LightkubeApiError
from lightkube.core.exceptions import ConfigError as LightkubeConfigError

from agent.kube import errors
from agent.kube.errors import ClusterConfigError
from agent.kube.metrics import ApiRequestCounter
from agent.kube.model import WatchEvent
from agent.kube.podlist import MAX_LIST_BYTES, read_bounded, status_message
from agent.kube.transport import CountingTransport

FIELD_MANAGER = "gpu-node-agent"
T = TypeVar("T")


def retry_after(response: httpx2.Response | None) -> float | None:
    """The Retry-After header in seconds, if the answer has a numeric one."""
    if response is None:
        return None
    try:
        return float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None


def translate(exc: BaseException) -> errors.ApiError:
    """Our exception for any client-side failure."""
    if isinstance(exc, LightkubeApiError):
        response = exc.response if isinstance(getattr(exc, "response", None), httpx2.Response) else None
        code = response.status_code if response is not None else int(exc.status.code or 500)
        return errors.error_for_status(code, exc.status.message or "", retry_after(response))
    if isinstance(exc, httpx2.HTTPStatusError):
        return errors.error_for_status(exc.response.status_code, exc.response.reason_phrase,
                                       retry_after(exc.response))
    if isinstance(exc, httpx2.TimeoutException):
        return errors.ApiTimeout(f"timed out: {type(exc).__name__}")
    if isinstance(exc, httpx2.HTTPError):
        return errors.ApiUnavailable(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, LightkubeConfigError):  # e.g. the projected token file is briefly missing
        return errors.ApiUnavailable(f"credentials: {exc}")
    if isinstance(exc, (msgspec.DecodeError, json.JSONDecodeError)):
        return errors.ApiServerError(502, f"undecodable response: {exc}")
    raise TypeError(f"not an API failure: {exc!r}")  # a bug here, not an API error


FAILURES = (httpx2.HTTPError, msgspec.DecodeError, json.JSONDecodeError, LightkubeConfigError)


def async_client(counter: ApiRequestCounter, kubeconfig: str | None, timeout: float) -> AsyncClient:
    """A lightkube client from a kubeconfig file, or the in-cluster service account when none is given."""
    try:
        config = KubeConfig.from_file(kubeconfig) if kubeconfig else KubeConfig.from_service_account()
        single = config.get()
    except (LightkubeConfigError, KeyError, OSError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster service account"
        raise ClusterConfigError(f"cannot use {where} ({exc}); set --kubeconfig or run in a pod with a "
                                 f"service account") from exc
    if single is None or single.user is None:
        raise ClusterConfigError(f"kubeconfig {kubeconfig} has no current context with a user")
    verify = verify_cluster(single.cluster, single.user, single.abs_file)
    transport = CountingTransport(httpx2.AsyncHTTPTransport(verify=verify), counter)
    return AsyncClient(single, timeout=httpx2.Timeout(timeout), field_manager=FIELD_MANAGER, transport=transport)


async def send_list(client: AsyncClient, res: type[Any], *, namespace: str | None = None, watch: bool = False,
                    params: dict[str, Any], timeout: httpx2.Timeout | None = None) -> httpx2.Response:
    """Send one LIST (or watch) request and return the streamed response, unread; the caller closes it."""
    generic = client._client
    try:
        br = generic.prepare_request("list", res=res, namespace=namespace, watch=watch, params=params)
        if timeout is not None:
            br.timeout = timeout
        return await generic.send(generic.build_adapter_request(br), stream=True)
    except FAILURES as exc:
        raise translate(exc) from exc


async def read_list(client: AsyncClient, res: type[Any], *, namespace: str | None = None, params: dict[str, Any],
                    limit: int = MAX_LIST_BYTES, what: str = "pod list") -> bytearray:
    """One LIST answer's body, read with a size bound (ApiServerError 502 past `limit`); an error status raises
    its `errors.Api*` exception with the Status message."""
    response = await send_list(client, res, namespace=namespace, params=params)
    try:
        if response.status_code >= 400:
            await response.aread()
            raise errors.error_for_status(response.status_code, status_message(response.content),
                                          retry_after(response))
        return await read_bounded(response.aiter_bytes(), limit, what)
    except FAILURES as exc:
        raise translate(exc) from exc
    finally:
        await response.aclose()


class Calls:
    """What each group of the real port's requests works with: the client, this node, and `_do`, which turns a
    request's failure into ours. `LightkubeCluster` sets these; the groups (`agent.kube.pod_calls`,
    `agent.kube.nodefeature_calls`) are its bases."""

    _client: AsyncClient
    _timeout: float
    node_name: str

    async def _do(self, call: Callable[[], Any]) -> Any:
        try:
            return await call()
        except FAILURES as exc:
            raise translate(exc) from exc
        except ValueError as exc:  # url_segment refused a name before any request was sent
            raise errors.ApiError(400, f"refused before sending: {exc}") from exc

    async def _watch(self, res: type[Any], namespace: str | None, selector: str, resource_version: str, *,
                     timeout_seconds: int, parse: Callable[[Mapping[str, Any]], T]) -> AsyncGenerator[WatchEvent[T]]:
        """One watch request with bookmarks; ERROR lines become exceptions (410: ApiGone)."""
        response = await send_list(self._client, res, namespace=namespace, watch=True, params={
            "fieldSelector": selector, "resourceVersion": resource_version or None,
            "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)},
            timeout=httpx2.Timeout(self._timeout, read=timeout_seconds + 30.0))
        try:
            if response.status_code >= 400:
                await response.aread()
                raise errors.error_for_status(response.status_code, response.text[:200], retry_after(response))
            async for line in response.aiter_lines():
                if line.strip():
                    yield _watch_event(line, parse)
        except FAILURES as exc:
            raise translate(exc) from exc
        finally:
            await response.aclose()


def _watch_event(line: str, parse: Callable[[Mapping[str, Any]], T]) -> WatchEvent[T]:
    try:
        event = json.loads(line)
        kind, obj = event["type"], event.get("object") or {}
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.ApiServerError(502, f"undecodable watch line: {line[:120]!r}") from exc
    if kind == "ERROR":
        raise errors.error_for_status(int(obj.get("code") or 500), obj.get("message") or "")
    version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    if kind == "BOOKMARK":
        return WatchEvent("BOOKMARK", version)
    return WatchEvent(kind, version, parse(obj))
