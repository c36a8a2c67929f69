"""The pods of this node, kept current from the API server by the shared reflector loop.

Only pods with `spec.nodeName=<node>` are ever listed or watched (served from the API server's watch-cache
index, like the kubelet's own pod watch); the loop itself (bookmarks, resume, 410 re-list, backoff) is
`agent.kube.reflector.Reflector`. A re-list replaces the whole set, dropping pods deleted during the gap (a
watch restarted without a version would never report them).

The owner sees the set through `on_change`, called after the first successful list and after every change;
before that the set is unknown (`synced` is False). `run` returns as soon as `stop` is set, cancelling an
open watch.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from agent.clock import SYSTEM_CLOCK, Clock
from agent.kube.model import PodView, WatchEvent
from agent.kube.port import PodWatchApi
from agent.kube.reflector import MAX_BACKOFF, WATCH_TIMEOUT, Reflector
from agent.supervisor import Backoff

log = logging.getLogger(__name__)

PodsChanged = Callable[[tuple[PodView, ...]], None]


class NodePodWatch:
    """List + watch of the pods bound to `api.node_name`; `pods` is the current set once `synced`."""

    def __init__(self, api: PodWatchApi, on_change: PodsChanged, *, clock: Clock = SYSTEM_CLOCK,
                 rng: random.Random | None = None, timeout_range: tuple[int, int] = WATCH_TIMEOUT,
                 backoff: Backoff | None = None) -> None:
        self.api = api
        self.on_change = on_change
        self.clock = clock
        self.pods: dict[tuple[str, str], PodView] = {}
        self.synced = False
        rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.reflector: Reflector[PodView] = Reflector(
            f"the pods of node {api.node_name}", self._relist, api.watch_pods, self._apply, log=log, clock=clock,
            rng=rng, timeout_range=timeout_range, backoff=backoff or Backoff(1.0, MAX_BACKOFF, jitter=0.2, rng=rng))

    @property
    def relists(self) -> int:
        """Successful lists so far (the first one included)."""
        return self.reflector.relists

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the set current until `stop` is set; re-raises only a bug (API errors are retried)."""
        await self.reflector.run(stop)

    async def _relist(self) -> str:
        listing = await self.api.list_node_pods()
        fresh = {pod.key: pod for pod in listing.pods}
        vanished = self.pods.keys() - fresh.keys()
        if vanished and self.synced:
            log.info("pod list of node %s: %d pods went away while unwatched", self.api.node_name, len(vanished))
        changed = fresh != self.pods or not self.synced
        self.pods = fresh
        self.synced = True
        if changed:
            self._publish()
        return listing.resource_version

    def _apply(self, event: WatchEvent[PodView]) -> None:
        pod = event.object
        if pod is None:  # BOOKMARK: only the version moves
            return
        if event.type == "DELETED":
            if self.pods.pop(pod.key, None) is not None:
                self._publish()
            return
        if event.type in ("ADDED", "MODIFIED"):
            if self.pods.get(pod.key) != pod:
                self.pods[pod.key] = pod
                self._publish()
            return
        log.debug("pod watch: ignoring a %s event", event.type)

    def _publish(self) -> None:
        self.on_change(tuple(sorted(self.pods.values(), key=lambda p: p.key)))
