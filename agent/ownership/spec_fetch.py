"""Pod specs the own-node watch has not delivered yet, fetched one pod at a time when a preference call needs them.

Only for the case the kubelet's records cannot settle (`OwnershipService.lookup`): several containers newly hold
partner devices in different places and some of their pods have no spec. Each such pod is one namespaced LIST
with `fieldSelector=metadata.name=<pod>,spec.nodeName=<node>` (`PodLookupApi`): the `list pods` grant the pod
watch already needs, and the answer is bounded to this node, where a GET could read any pod in the cluster
(RBAC cannot limit `get` to the own node). At most `MAX_PODS` per call, in parallel, waited on only until the
call's deadline; a fetch still running then goes on (bounded by `late_s`) and its answer teaches the next call.

Fetched specs are kept until the watch delivers the pod (the spec is the same: a pod's containers and their
extended resources cannot change) or the kubelet stops listing it, and at most `CAPACITY` of them.
`gpu_node_agent_pod_spec_fetches_total{outcome}` counts each fetch once, when it ends: `found` (before the
call's deadline), `late` (found after it: used by the next call), `not_found` (no such pod on this node: gone),
`error` (API error or no answer within `late_s`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter

from agent import aio
from agent.kube.errors import ApiError
from agent.kube.model import PodView
from agent.kube.port import PodLookupApi

log = logging.getLogger(__name__)

MAX_PODS = 4  # pods fetched per preference call: two pods admitted back to back is the case; more is a burst
CAPACITY = 64  # fetched specs kept (pods the watch still lags on); the kubelet admits one pod at a time
LATE_S = 2.0  # a fetch's own bound: past it the API server is too slow to teach anything
OUTCOMES = ("found", "late", "not_found", "error")

PodKey = tuple[str, str]  # (namespace, name)


class PodSpecFetcher:
    """Fetches and keeps the specs of pods the watch lacks; `spec` reads what is kept."""

    def __init__(self, api: PodLookupApi, registry: CollectorRegistry | None, *, late_s: float = LATE_S) -> None:
        self.api = api
        self.late_s = late_s
        self.fetched: dict[PodKey, PodView] = {}
        self._inflight: dict[PodKey, asyncio.Task[PodView | None]] = {}
        self._late: set[PodKey] = set()  # fetches whose first caller stopped waiting
        self._outcomes = Counter("gpu_node_agent_pod_spec_fetches",
                                 "Pod specs fetched for preference calls (pods the own-node watch had not "
                                 "delivered), by outcome: found, late (after the call's deadline), not_found, "
                                 "error", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self._outcomes.labels(outcome)

    def spec(self, key: PodKey) -> PodView | None:
        """A fetched spec, None when none is kept."""
        return self.fetched.get(key)

    async def fetch(self, keys: Iterable[PodKey], timeout: float) -> dict[PodKey, PodView]:
        """Fetch the specs of `keys` (at most `MAX_PODS`, joining fetches in flight) and wait for them at most
        `timeout` seconds; returns the specs known then. Never raises for API failures."""
        asked = list(dict.fromkeys(keys))
        wanted = [k for k in asked if k not in self.fetched][:MAX_PODS]
        tasks = [self._start(k) for k in wanted]
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=max(timeout, 0.0))
        finally:
            # also when the caller is cancelled while waiting (the kubelet gave up on the preference call): an
            # answer after that served no call in time, so it counts as late
            self._late.update(k for k, t in zip(wanted, tasks, strict=True) if not t.done())
        # every asked-for spec known now, kept ones included (not only those this call fetched)
        return {k: self.fetched[k] for k in asked if k in self.fetched}

    def _start(self, key: PodKey) -> asyncio.Task[PodView | None]:
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(key), name=f"pod-spec-fetch {key[0]}/{key[1]}")
            self._inflight[key] = task
        return task

    async def _fetch(self, key: PodKey) -> PodView | None:
        try:
            pod = await asyncio.wait_for(self.api.find_node_pod(*key), self.late_s)
        except (ApiError, TimeoutError) as exc:
            log.debug("cannot fetch the spec of pod %s/%s: %s", *key, exc or "timed out")
            self._count(key, "error")
            return None
        if pod is None:
            self._count(key, "not_found")
            return None
        if len(self.fetched) >= CAPACITY:
            self.fetched.pop(next(iter(self.fetched)))  # the oldest: its pod has been admitted long since
        self.fetched[key] = pod
        self._count(key, "late" if key in self._late else "found")
        return pod

    def _count(self, key: PodKey, outcome: str) -> None:
        self._inflight.pop(key, None)
        self._late.discard(key)
        self._outcomes.labels(outcome).inc()

    def forget(self, keep: Callable[[PodKey], bool]) -> None:
        """Drop the kept specs for which `keep` is False (the watch has the pod, or the kubelet lists it no more)."""
        for key in [k for k in self.fetched if not keep(k)]:
            del self.fetched[key]

    async def aclose(self) -> None:
        """Cancel fetches in flight."""
        await aio.cancel_and_wait(*self._inflight.values())
