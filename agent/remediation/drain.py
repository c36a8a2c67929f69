"""Drain: evict this node's pods through the policy/v1 Eviction API, so PodDisruptionBudgets are honoured.

Like `kubectl drain --ignore-daemonsets`, it skips DaemonSet pods (they tolerate the cordon and would come
back), mirror (static) pods, finished pods and the agent's own pod. Before every eviction it asks `wanted()`
whether the fault still calls for a drain (draino#50, #116 drained after the condition cleared). Answers:
200/201 evicted; 404 already gone; 429 a PDB (or API throttling) says not now: back off exponentially, honour
Retry-After; 500 misconfiguration such as several PDBs on one pod: report (Warning Event) and keep trying at a
slow pace, since a person may fix the PDBs. At the deadline it stops and reports what is left.

Each pod is treated by its drain mode (`drainmodes`): evicted at once, at its time after the fault, or never
(it is waited for); one Event on each pod says which mode applies and when it will be evicted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agent.clock import Clock
from agent.kube.errors import ApiError, ApiNotFound, ApiServerError, ApiTooManyRequests
from agent.kube.model import ObjectRef, PodView
from agent.kube.port import PodApi
from agent.remediation.drainmodes import DrainPlanner, PodPlan
from agent.remediation.events import WARNING, EventRecorder
from agent.remediation.metrics import ActionCounter
from agent.supervisor import Backoff

log = logging.getLogger(__name__)

#: How often pods are re-listed while evicted pods terminate (only during a drain, never in steady state).
POLL_SECONDS = 10.0
_DONE_PHASES = ("Succeeded", "Failed")

#: The pods a narrowed drain takes this round ("namespace/name"); None: not known now
Selector = Callable[[], Awaitable[frozenset[str] | None]]


@dataclass(frozen=True)
class DrainResult:
    """How a drain ended: complete, deadline, or stopped (fault cleared or agent stopping)."""

    outcome: str
    remaining: tuple[str, ...] = ()


def evictable(pods: list[PodView], own_pod: tuple[str, str]) -> list[PodView]:
    """The pods a drain must remove."""
    return [p for p in pods
            if "DaemonSet" not in p.owner_kinds and not p.mirror and p.phase not in _DONE_PHASES
            and (p.namespace, p.name) != own_pod]


class Drainer:
    """One drain at a time; `run` returns when done, at the deadline, or when stopped."""

    def __init__(self, api: PodApi, clock: Clock, events: EventRecorder, actions: ActionCounter, *,
                 own_pod: tuple[str, str], planner: DrainPlanner, pod_events: EventRecorder | None = None,
                 backoff_seconds: float = 5.0, backoff_max_seconds: float = 120.0,
                 blocked_retry_seconds: float = 300.0, dry_run: bool = False) -> None:
        self._api = api
        self._planner = planner
        self._pod_events = pod_events or events
        self._clock = clock
        self._events = events
        self._actions = actions
        self._own_pod = own_pod
        self._backoff_initial = backoff_seconds
        self._backoff_max = max(backoff_max_seconds, backoff_seconds)
        self._blocked_retry = blocked_retry_seconds
        self._dry_run = dry_run

    async def run(self, stop: asyncio.Event, deadline: float, wanted: Callable[[], bool],
                  fault_at: float | None = None, *, select: Selector | None = None,
                  scope: str = "") -> DrainResult:
        """Evict until no evictable pod is left; drain-mode times count from `fault_at` (default: now).

        `select` narrows the drain to some pods (an isolated device's holders: "namespace/name"), asked afresh
        every round; None from it means they cannot be known now, and the round is retried with backoff (never
        taken for "none left"). `scope` names them in the Events ("the pods holding GPU-..."), empty for the
        whole node.
        """
        what = f" ({scope})" if scope else ""
        backoff = Backoff(self._backoff_initial, self._backoff_max)
        fault = self._clock.now() if fault_at is None else fault_at
        plans: dict[str, PodPlan] = {}  # by pod uid (or namespace/name): announced once per drain
        remaining: tuple[str, ...] = ()
        announced = False
        while not stop.is_set():
            if not wanted():
                return DrainResult("stopped", remaining)
            now = self._clock.now()
            if now >= deadline:
                await self._events.emit("DrainDeadlineExceeded", f"drain{what} stopped at its deadline with "
                                        f"{len(remaining)} pods left: {_names(remaining)}", WARNING)
                self._actions.count("drain", "deadline")
                return DrainResult("deadline", remaining)
            found = await self._todo(select, what)
            todo, leaving = found if found is not None else ([], remaining)
            remaining = tuple(f"{p.namespace}/{p.name}" for p in todo) or leaving
            if found is None or (leaving and not todo):  # not known now, or evicted pods whose devices the kubelet
                wait = backoff.next() if found is None else POLL_SECONDS  # still lists: not over yet
                await self._clock.wait(stop, max(0.0, min(wait, deadline - now)))
                continue
            if not todo:
                await self._events.emit("DrainComplete", f"all evictable pods{what} are gone")
                self._actions.count("drain", "complete")
                return DrainResult("complete")
            if not announced:
                announced = True
                await self._events.emit("Draining", f"evicting {len(todo)} pods{what}: {_names(remaining)}")
            due = []
            for pod in todo:
                plan = await self._plan(plans, pod, fault, deadline)
                if plan.evict_at is not None and not pod.terminating:
                    due.append((plan.evict_at, pod))
            if self._dry_run:
                self._actions.count("drain", "dry_run")
                return DrainResult("complete", remaining)
            wait = POLL_SECONDS
            for evict_at, pod in due:
                if stop.is_set() or not wanted() or self._clock.now() >= deadline:
                    break
                if evict_at > self._clock.now():
                    continue
                outcome, pause = await self._evict(pod, backoff.delay)
                if outcome == "ok":
                    backoff.reset()
                elif outcome == "throttled":
                    backoff.next()  # the next refusal waits longer
                wait = max(wait, pause)
            later = [at - self._clock.now() for at, _pod in due if at > self._clock.now()]
            if later:  # wake for the next scheduled eviction, not a poll later
                wait = min(wait, *later)
            await self._clock.wait(stop, max(0.0, min(wait, deadline - self._clock.now())))
        return DrainResult("stopped", remaining)

    async def _todo(self, select: Selector | None,
                    what: str) -> tuple[list[PodView], tuple[str, ...]] | None:
        """The evictable pods this round (the selected ones when narrowed), and the selected pods that are leaving
        (no longer evictable in the API, but still selected: the kubelet still lists their devices); None when
        the pods cannot be listed or the selection is unknown."""
        chosen = await select() if select is not None else None
        if select is not None and chosen is None:
            log.warning("drain%s: cannot tell which pods hold the devices now; retrying", what)
            return None
        try:
            pods = await self._api.list_pods()
        except ApiError as exc:
            log.warning("drain%s: cannot list pods: %s", what, exc)
            return None
        todo = [p for p in evictable(pods, self._own_pod) if chosen is None or f"{p.namespace}/{p.name}" in chosen]
        if chosen is None:
            return todo, ()
        kept = {f"{p.namespace}/{p.name}" for p in pods  # never evicted by a drain: they may keep their devices
                if "DaemonSet" in p.owner_kinds or p.mirror or (p.namespace, p.name) == self._own_pod}
        listed = {f"{p.namespace}/{p.name}" for p in todo}
        return todo, tuple(sorted(chosen - kept - listed))

    async def _plan(self, plans: dict[str, PodPlan], pod: PodView, fault: float, deadline: float) -> PodPlan:
        """The pod's drain plan, announced by an Event on the pod the first time it is seen in this drain."""
        key = pod.uid or f"{pod.namespace}/{pod.name}"
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = self._planner.plan(pod, fault)
            self._actions.count("drain_mode", plan.mode)
            await self._pod_events.emit("DrainScheduled", plan.describe(deadline),
                                        involved=ObjectRef("Pod", pod.namespace, pod.name, pod.uid))
        return plan

    async def _evict(self, pod: PodView, backoff: float) -> tuple[str, float]:
        """Evict one pod: (outcome, seconds to wait before the next round)."""
        name = f"{pod.namespace}/{pod.name}"
        try:
            await self._api.evict_pod(pod.namespace, pod.name)
        except ApiNotFound:
            self._actions.count("evict", "gone")
            return "ok", 0.0
        except ApiTooManyRequests as exc:
            self._actions.count("evict", "throttled")
            log.info("drain: eviction of %s refused (429, PodDisruptionBudget or throttling); backing off", name)
            return "throttled", max(backoff, exc.retry_after or 0.0)
        except ApiServerError as exc:
            self._actions.count("evict", "blocked")
            await self._events.emit("EvictionBlocked", f"eviction of {name} failed ({exc.code}): {exc.message}; "
                                    f"several PodDisruptionBudgets may select it. Retrying slowly.", WARNING)
            return "blocked", self._blocked_retry
        except ApiError as exc:
            self._actions.count("evict", "failed")
            log.warning("drain: eviction of %s failed: %s", name, exc)
            return "failed", backoff
        self._actions.count("evict", "ok")
        log.info("drain: evicted %s", name)
        return "ok", 0.0


def _names(names: tuple[str, ...], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
