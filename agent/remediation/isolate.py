"""Isolation: one device out of service and only the pods holding it drained; the node stays schedulable.

A health verdict `isolate` names one device (a GPU, or a NIC's PF with its VFs; two devices make the verdict a
node drain, see `agent.health.verdict`). The device plugin already reports the device Unhealthy, so no new pod
gets it; what is left is the pods that hold it now, which the kubelet's PodResources names (`agent.ownership`,
reached through `pods_of`): asked afresh when the isolation starts and at every round of its drain, so a pod
admitted a moment before the fault is drained, and the drain is complete only when a fresh reading shows no
holder (a kubelet that does not answer keeps the drain going, it never completes it). They are drained by their
drain mode exactly as in a node drain (Immediate, AllowCompletion, DeleteAfterTimeout counted from the fault); no
other pod is touched, the node is not cordoned and no Lease slot is taken, since nothing node-wide happens.

Recorded on the node (`P/isolated-devices`, `P/isolated-since`, `P/isolate-drain`) so a restarted agent goes on
with the same drain (the drain-mode clocks keep counting from the fault) and neither counts nor announces the
isolation again. It ends when the verdict no longer isolates those devices: the device recovered (a reset), or
the fault grew into a node fault, whose cordon and drain then take over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from agent.clock import Clock
from agent.config.remediation import RemediationConfig
from agent.kube.model import format_time, parse_time
from agent.remediation import state
from agent.remediation.actions import NodeActions
from agent.remediation.drain import Drainer, DrainResult
from agent.remediation.events import WARNING, EventRecorder
from agent.remediation.metrics import ActionCounter
from agent.signals import NodeVerdict, Severity

log = logging.getLogger(__name__)

#: device IDs -> "namespace/name" of the pods holding them now (the ownership service's `pods_holding_now`);
#: None when the kubelet cannot be asked
PodsOf = Callable[[Sequence[str]], Awaitable[list[str] | None]]


@dataclass(frozen=True)
class IsolationKeys:
    """The node annotations that record an isolation."""

    devices: str
    since: str
    drain: str

    @classmethod
    def for_prefix(cls, prefix: str) -> IsolationKeys:
        """`<prefix>/isolated-devices`, `<prefix>/isolated-since`, `<prefix>/isolate-drain`."""
        return cls(f"{prefix}/isolated-devices", f"{prefix}/isolated-since", f"{prefix}/isolate-drain")


def isolated_devices(verdict: NodeVerdict | None) -> tuple[str, ...]:
    """The devices an isolate verdict takes out of service; () for any other verdict."""
    if verdict is None or verdict.severity is not Severity.ISOLATE:
        return ()
    return verdict.devices


class Isolation:
    """Keeps the node's isolation record and the drain of the isolated device's pods in step with the verdict."""

    def __init__(self, config: RemediationConfig, *, actions: NodeActions, events: EventRecorder, drainer: Drainer,
                 clock: Clock, counter: ActionCounter, wake: Callable[[], None], pods_of: PodsOf | None) -> None:
        self.config = config
        self.keys = IsolationKeys.for_prefix(config.prefix)
        self.pods_of = pods_of  # None: no PodResources configured, nobody can be named
        self._actions = actions
        self._events = events
        self._drainer = drainer
        self._clock = clock
        self._counter = counter
        self._wake = wake
        self._target: tuple[str, ...] = ()
        self._task_target: tuple[str, ...] = ()
        self._task: asyncio.Task[DrainResult] | None = None
        self._stop = asyncio.Event()

    def recorded(self) -> tuple[str, ...]:
        """The devices recorded as isolated on the node."""
        text = self._actions.node.annotations.get(self.keys.devices, "")
        return tuple(d for d in text.split(",") if d)

    async def reconcile(self, verdict: NodeVerdict | None) -> None:
        """Start, continue or end the isolation the verdict asks for; raises ApiError (the caller retries)."""
        await self._collect()
        if verdict is None:  # nothing known yet (a restarted agent before its first verdict): keep the record
            return
        target = isolated_devices(verdict)
        self._target = target
        recorded = self.recorded()
        if recorded and recorded != target:
            await self._end(recorded, verdict)
        if not target:
            return
        if self.recorded() != target:
            now = self._clock.now()
            devices = ",".join(target)
            if not await self._actions.apply("isolate", lambda n: state.annotate(
                    {self.keys.devices: devices, self.keys.since: format_time(now), self.keys.drain: "running"})):
                return
            pods = await self.holders(target)
            held = (f"; draining the pods holding it: {', '.join(pods)}" if pods
                    else "; no pod holds it" if pods is not None
                    else "; which pods hold it is unknown (the kubelet's PodResources did not answer)")
            await self._events.emit("DeviceIsolated", f"{verdict.reason}: {verdict.describe()}: the device stays "
                                    f"Unhealthy and the node schedulable{held}", WARNING)
        if self.config.drain and self._task is None and \
                self._actions.node.annotations.get(self.keys.drain, "running") == "running":
            self._start_drain(target)

    async def holders(self, devices: Sequence[str]) -> list[str] | None:
        """The pods holding the devices according to the kubelet now; None when that cannot be known (no
        PodResources, or it did not answer)."""
        if self.pods_of is None:
            return None
        try:
            return await self.pods_of(devices)
        except Exception:  # naming holders must not stop remediation
            log.exception("cannot tell which pods hold %s", ", ".join(devices))
            return None

    def _start_drain(self, target: tuple[str, ...]) -> None:
        annotations = self._actions.node.annotations
        since = parse_time(annotations.get(self.keys.since)) or self._clock.now()
        deadline = since + self.config.drain_deadline_seconds

        async def holding() -> frozenset[str] | None:
            if self.pods_of is None:  # no PodResources configured: nobody can be named (the Event said so)
                return frozenset()
            pods = await self.holders(target)
            return None if pods is None else frozenset(pods)

        self._stop = asyncio.Event()
        self._task_target = target
        self._task = asyncio.create_task(
            self._drainer.run(self._stop, deadline, lambda: self._target == target, since, select=holding,
                              scope=f"the pods holding {', '.join(target)}"),
            name="remediation-isolate-drain")
        self._task.add_done_callback(lambda _task: self._wake())

    async def _collect(self) -> None:
        task = self._task
        if task is None or not task.done():
            return
        self._task = None
        result = task.result()
        if result.outcome in ("complete", "deadline") and self.recorded() == self._task_target:
            await self._actions.apply("annotate", lambda n: state.annotate({self.keys.drain: result.outcome}))

    async def _end(self, devices: tuple[str, ...], verdict: NodeVerdict) -> None:
        self._stop.set()
        if await self._actions.apply("annotate", lambda n: state.annotate(
                {self.keys.devices: None, self.keys.since: None, self.keys.drain: None})):
            escalated = verdict.severity >= Severity.CORDON
            why = (f"the fault now concerns the node ({verdict.reason}): the node path takes over" if escalated
                   else "the device is healthy again")
            await self._events.emit("DeviceIsolationEnded", f"{', '.join(devices)}: {why}",
                                    WARNING if escalated else "Normal")

    async def close(self) -> None:
        """Stop a running drain and wait for it."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
