"""This node's pods through the real port: the LIST and watch by `spec.nodeName`, the lookup of one pod, and the
eviction; a base of `agent.kube.cluster.LightkubeCluster`.

An answer may hold pods of other nodes (a server or proxy ignoring the field selector): they are skipped, counted
on `gpu_node_agent_apiserver_foreign_pods_total{request}` and warned about once per request kind. A LIST is read
with a size bound and decoded in a worker thread (`agent.kube.podlist`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from prometheus_client import Counter

from agent.kube import errors
from agent.kube.calls import Calls, read_list
from agent.kube.model import PodList, PodView, WatchEvent
from agent.kube.names import url_segment
from agent.kube.podlist import DecodedPods, decode_node_pods

log = logging.getLogger(__name__)

ALL_NAMESPACES = "*"


class PodCalls(Calls):
    """`port.PodApi`, `port.PodWatchApi` and `port.PodLookupApi` on lightkube."""

    _foreign: Counter  # pods of other nodes skipped, by request kind
    _warned: set[str]  # requests whose foreign pods were logged as a warning

    async def watch_pods(self, resource_version: str, timeout_seconds: int) -> AsyncIterator[WatchEvent[PodView]]:
        """One watch of this node's pods (fieldSelector spec.nodeName, all namespaces) with bookmarks; events of
        other nodes' pods (a server ignoring the selector) are skipped and counted."""
        def own_pod(obj: Mapping[str, Any]) -> PodView | None:
            return PodView.from_dict(obj) if (obj.get("spec") or {}).get("nodeName") == self.node_name else None

        events = self._watch(Pod, ALL_NAMESPACES, f"spec.nodeName={self.node_name}", resource_version,
                             timeout_seconds=timeout_seconds, parse=own_pod)
        async with contextlib.aclosing(events):  # the response closes with this watch, not at garbage collection
            async for event in events:
                if event.type != "BOOKMARK" and event.object is None:
                    self._skipped("watch_pods", 1)
                    continue
                yield cast(WatchEvent[PodView], event)

    async def list_pods(self) -> list[PodView]:
        """Pods on this node only (fieldSelector spec.nodeName), all namespaces."""
        return list((await self.list_node_pods()).pods)

    async def list_node_pods(self) -> PodList:
        """Pods on this node only, with the list's resourceVersion (where a watch continues)."""
        decoded = await self._list_node_pods(ALL_NAMESPACES, f"spec.nodeName={self.node_name}", "list_node_pods")
        if not decoded.resource_version:
            raise errors.ApiServerError(502, "pod list without a resourceVersion")
        return PodList(decoded.pods, decoded.resource_version)

    async def find_node_pod(self, namespace: str, name: str) -> PodView | None:
        """One pod by name, only if it is on this node: a LIST in its namespace with both field selectors (a consistent
        read, no resourceVersion: the watch cache may lag as the watch does). Pods of other nodes or with other names
        in the answer (a server ignoring the field selector) are skipped; two pods by the name are not believed."""
        try:
            path_ns, path_name = url_segment(namespace, namespace=True), url_segment(name)
        except ValueError as exc:  # refused before any request is sent
            raise errors.ApiError(400, f"refused before sending: {exc}") from exc
        decoded = await self._list_node_pods(path_ns, f"metadata.name={path_name},spec.nodeName={self.node_name}",
                                             "find_node_pod")
        pods = [p for p in decoded.pods if p.key == (namespace, name)]
        if len(pods) > 1:
            raise errors.ApiServerError(502, f"a list of pod {namespace}/{name} returned it {len(pods)} times")
        return pods[0] if pods else None

    async def _list_node_pods(self, namespace: str, selector: str, request: str) -> DecodedPods:
        """One pod LIST, read with a size bound and decoded in a worker thread (`agent.kube.podlist`): a proxy that
        drops the selector answers with the whole cluster, which must neither hold the loop nor be believed."""
        body = await read_list(self._client, Pod, namespace=namespace, params={"fieldSelector": selector})
        decoded = await asyncio.to_thread(decode_node_pods, body, self.node_name)
        if decoded.foreign:
            self._skipped(request, decoded.foreign)
        return decoded

    def _skipped(self, request: str, pods: int) -> None:
        """Count pods of other nodes in an answer; warn once per request kind (a proxy that ignores selectors does
        so on every request), then at debug level."""
        self._foreign.labels(request).inc(pods)
        level = logging.DEBUG if request in self._warned else logging.WARNING
        self._warned.add(request)
        log.log(level, "the API server answered %s with %d pods of other nodes: it ignores the field selector; they "
                "were skipped (gpu_node_agent_apiserver_foreign_pods_total)", request, pods)

    async def evict_pod(self, namespace: str, name: str) -> None:
        """policy/v1 Eviction (lightkube fills apiVersion and kind)."""
        async def call() -> None:
            path_name, path_ns = url_segment(name), url_segment(namespace, namespace=True)
            eviction = Pod.Eviction(metadata=ObjectMeta(name=name, namespace=namespace))
            await self._client.create(eviction, name=path_name, namespace=path_ns)
        await self._do(call)
