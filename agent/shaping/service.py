"""The shaping service: keeps the shapers in line with the pods, reports bad annotations as Events.

One asyncio loop owned by the supervisor through a stop event, shaped like netacct's: each round runs one sync
in a worker thread (netlink blocks), then waits for a pod change, the retry delay (while a pod's interface is not
found yet or failed), the sync interval, or stop. A failed sync is logged and retried with backoff, never ending
the loop. The pod source is the process's one (`agent.pods`), shared with netacct when both run; `owns_source`
says whether this service runs it.

An invalid annotation is a Warning Event on the pod (`InvalidBandwidthAnnotation`) and a log line, once per
pod, annotation and value; the value appears in the Event only as text (quoted, cut at 64 characters).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import CollectorRegistry

from agent import aio
from agent.config.shaping import ShapingConfig, parse_defaults
from agent.host.tc import Network, TcError, TcPort
from agent.kube.model import EventRecord, ObjectRef
from agent.kube.port import EventApi
from agent.pods.source import PodSource
from agent.shaping.collector import ShapingCollector
from agent.shaping.engine import Shaper, SyncReport
from agent.supervisor import Backoff

log = logging.getLogger(__name__)

EVENT_REASON = "InvalidBandwidthAnnotation"


class ShapingService:
    """Per-pod internet shaping for one node (or one network namespace, given a port opened there)."""

    def __init__(self, config: ShapingConfig, internal: list[Network], registry: CollectorRegistry,
                 pods: PodSource, port: TcPort, *, events: EventApi | None = None, owns_source: bool = True,
                 settle_seconds: float = 0.2, backoff_initial: float = 1.0) -> None:
        self.config = config
        self.shaper = Shaper(port, internal, parse_defaults(config.namespace_defaults))
        self.pods = pods
        self.owns_source = owns_source
        self.events = events
        self.collector = ShapingCollector(self.shaper)
        self.registry = registry
        self.settle_seconds = settle_seconds
        self.backoff_initial = backoff_initial
        self.synced = asyncio.Event()  # set after each successful sync (tests and readiness)
        self._reported: set[tuple[str, str, str, str]] = set()
        registry.register(self.collector)

    async def run(self, stop: asyncio.Event) -> None:
        """Sync now, then on every pod change, retry delay and sync interval, until `stop` is set."""
        source = asyncio.create_task(self.pods.run(stop), name="shaping-pods") if self.owns_source else None
        # doubling from `backoff_initial` up to the sync interval, the wait a healthy round takes anyway
        backoff = Backoff(self.backoff_initial, max(self.backoff_initial, self.config.sync_interval_seconds))
        try:
            while not stop.is_set():
                version, pods = self.pods.snapshot()
                try:
                    report = await asyncio.to_thread(self.shaper.sync, pods)
                except Exception as exc:  # one failure must not end shaping; the next round retries
                    wait = backoff.next()
                    log.error("shaping: sync failed, retrying in %.1f s: %s", wait, exc,
                              exc_info=not isinstance(exc, (TcError, OSError)))
                else:
                    backoff.reset()
                    unsettled = report.count("pending") + report.count("error")
                    wait = self.config.retry_seconds if unsettled else self.config.sync_interval_seconds
                    if pods is not None:
                        self.synced.set()
                    await self._report_problems(report)
                if await self._wait(stop, version, wait):
                    await aio.sleep_or_stop(stop, self.settle_seconds)
        finally:
            if source is not None:
                await aio.cancel_and_wait(source)

    async def _wait(self, stop: asyncio.Event, version: int, timeout: float) -> bool:
        """Wait for a pod change, `timeout` or stop; True when the pods changed."""
        await aio.wait_any(stop, self.pods.wait_changed(version, timeout))
        return self.pods.snapshot()[0] != version

    async def _report_problems(self, report: SyncReport) -> None:
        current: set[tuple[str, str, str, str]] = set()
        for (namespace, name), (pod, problems) in sorted(report.problems.items()):
            for problem in problems:
                seen = (pod.uid or f"{namespace}/{name}", problem.annotation, problem.value, problem.direction)
                current.add(seen)
                if seen in self._reported:
                    continue
                self._reported.add(seen)
                message = (f"{problem.annotation}={problem.value!r} is not a bandwidth: {problem.reason}; "
                           f"{problem.direction} internet traffic of this pod runs unshaped")
                log.warning("shaping: pod %s/%s: %s", namespace, name, message)
                if self.events is None:
                    continue
                now = time.time()
                record = EventRecord(EVENT_REASON, message, "Warning", first_time=now, last_time=now,
                                     involved=ObjectRef("Pod", namespace, name, pod.uid))
                try:
                    await self.events.write_event(record)
                except Exception as exc:  # an Event is a courtesy; shaping goes on without it
                    log.warning("shaping: could not write an Event on pod %s/%s: %s", namespace, name, exc)
        self._reported &= current  # a pod gone or fixed is forgotten; breaking it again is reported again

    def close(self) -> None:
        """Unregister the collector and release the netlink socket; shapers stay (a restart adopts them)."""
        with contextlib.suppress(KeyError):
            self.registry.unregister(self.collector)
        self.shaper.close()

    def cleanup(self) -> list[str]:
        """Remove every shaper and IFB shaping made; what was removed."""
        removed = self.shaper.remove_all()
        self.close()
        return removed
