"""The pods of this node, kept current from the API server: list once, then watch from the list's version.

The client-go reflector pattern with the watch hygiene a 7,500-node DaemonSet needs (reference
node-remediation.md §7): only pods with `spec.nodeName=<node>` are ever listed or watched (served from the
API server's watch-cache index, like the kubelet's own pod watch); each watch asks for bookmarks and a
jittered 5-10 minute `timeoutSeconds`, and the next one resumes from the last version seen (an event or a
bookmark), so a quiet node costs about 8 watch requests an hour and no lists. Only a 410 (the version was
compacted away) re-lists, and that list replaces the whole set, dropping pods deleted during the gap (a
watch restarted without a version would never report them). Errors back off exponentially with jitter,
honouring Retry-After; a server that closes watches at once is treated as an error, not a reason to spin.

The owner sees the set through `on_change`, called after the first successful list and after every change;
before that the set is unknown (`synced` is False). `run` returns as soon as `stop` is set, cancelling an
open watch.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

from agent.clock import Clock, SystemClock
from agent.kube.errors import ApiError, ApiGone
from agent.kube.model import PodView, WatchEvent
from agent.kube.port import PodWatchApi

log = logging.getLogger(__name__)

WATCH_TIMEOUT = (300, 600)  # seconds; client-go picks 5-10 minutes at random per watch
MAX_BACKOFF = 300.0
QUICK_CLOSE = 1.0  # a watch that ends this fast having sent nothing counts as a failure

PodsChanged = Callable[[tuple[PodView, ...]], None]


class NodePodWatch:
    """List + watch of the pods bound to `api.node_name`; `pods` is the current set once `synced`."""

    def __init__(self, api: PodWatchApi, on_change: PodsChanged, *, clock: Clock | None = None,
                 rng: random.Random | None = None, timeout_range: tuple[int, int] = WATCH_TIMEOUT,
                 backoff_initial: float = 1.0, backoff_max: float = MAX_BACKOFF) -> None:
        self.api = api
        self.on_change = on_change
        self.clock = clock or SystemClock()
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.timeout_range = timeout_range
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.pods: dict[tuple[str, str], PodView] = {}
        self.version = ""  # where the next watch starts; empty: list first
        self.synced = False
        self.relists = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Keep the set current until `stop` is set; re-raises only a bug (API errors are retried)."""
        loop = asyncio.create_task(self._loop(stop), name="pod-watch")
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({loop, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (loop, stopper):
                task.cancel()
            await asyncio.gather(loop, stopper, return_exceptions=True)
        if loop.done() and not loop.cancelled() and loop.exception() is not None:
            raise loop.exception()  # type: ignore[misc]

    async def _loop(self, stop: asyncio.Event) -> None:
        backoff = self.backoff_initial
        gone_streak = 0
        while not stop.is_set():
            try:
                if not self.version:
                    await self._relist()
                    if not gone_streak:  # the server answers again (a run of 410s keeps backing off)
                        backoff = self.backoff_initial
                if await self._watch_once():
                    backoff, gone_streak = self.backoff_initial, 0
                    continue
                raise ApiError(0, "the pod watch closed at once")  # a broken proxy: do not spin
            except ApiGone:
                self.version = ""
                gone_streak += 1
                log.info("pod watch expired (410); listing the pods of node %s again", self.api.node_name)
                if gone_streak == 1:
                    continue  # re-list at once; a second 410 in a row backs off below
                wait = backoff * self._jitter()
            except ApiError as exc:
                wait = max(backoff * self._jitter(), exc.retry_after or 0.0)
                log.warning("pod watch of node %s failed: %s; retrying in %.0fs", self.api.node_name, exc, wait)
            await self.clock.wait(stop, wait)
            backoff = min(backoff * 2, self.backoff_max)

    def _jitter(self) -> float:
        return self._rng.uniform(0.8, 1.2)

    async def _relist(self) -> None:
        listing = await self.api.list_node_pods()
        fresh = {pod.key: pod for pod in listing.pods}
        vanished = self.pods.keys() - fresh.keys()
        if vanished and self.synced:
            log.info("pod list of node %s: %d pods went away while unwatched", self.api.node_name, len(vanished))
        changed = fresh != self.pods or not self.synced
        self.pods = fresh
        self.version = listing.resource_version
        self.relists += 1
        self.synced = True
        if changed:
            self._publish()

    async def _watch_once(self) -> bool:
        """One watch request; True when it made progress (an event, or it lasted a while)."""
        started = self.clock.now()
        seen = False
        timeout = self._rng.randint(*self.timeout_range)
        async for event in self.api.watch_pods(self.version, timeout):
            seen = True
            self.version = event.resource_version or self.version
            if self._apply(event):
                self._publish()
        return seen or self.clock.now() - started >= QUICK_CLOSE

    def _apply(self, event: WatchEvent[PodView]) -> bool:
        pod = event.object
        if pod is None:  # BOOKMARK: only the version moves
            return False
        if event.type == "DELETED":
            return self.pods.pop(pod.key, None) is not None
        if event.type in ("ADDED", "MODIFIED"):
            if self.pods.get(pod.key) == pod:
                return False
            self.pods[pod.key] = pod
            return True
        log.debug("pod watch: ignoring a %s event", event.type)
        return False

    def _publish(self) -> None:
        self.on_change(tuple(sorted(self.pods.values(), key=lambda p: p.key)))
