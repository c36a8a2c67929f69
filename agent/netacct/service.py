"""The netacct service: keeps rules and sets in line with the pod list, and serves the collector.

One asyncio loop owned by the app's supervisor through a stop event. Each round runs one sync in a worker thread
(subprocesses and netlink block), then waits for a pod change, the sync interval, or stop. A failed sync is logged
and retried with exponential backoff (capped at the sync interval); it never ends the loop. Pod changes arriving
in a burst are coalesced by a short settle delay. Between syncs, a read-only check every second notices netacct's
state changed by someone else and syncs at once (the repair; see repair).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from prometheus_client import CollectorRegistry

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.config.netacct import NetacctConfig
from agent.netacct.backend import Host
from agent.netacct.collector import NetacctCollector
from agent.netacct.engine import Netacct, SyncError
from agent.pods.choice import open_pod_source
from agent.pods.source import PodSource
from agent.supervisor import Backoff

log = logging.getLogger(__name__)

FOREVER = 365 * 86400.0  # a pod-change wait bounded by the clock's timeout, not its own
# Between syncs, how often to look whether someone else changed netacct's kernel state (one read, as a scrape):
# a deleted table or flushed chain stops counting until repaired, so waiting for the sync interval loses traffic.
REPAIR_CHECK_SECONDS = 1.0
# How long the first sync waits for the pod source's first list (a pods file is read by the source's own task, a
# pod watch needs its LIST): a first start that synced without it installed empty pod sets, and each pod's
# traffic until the next sync was counted for the node only. A restart loses nothing by waiting (the kernel keeps
# counting); past this, accounting starts without the pods and adds them when the list comes.
FIRST_PODS_WAIT_SECONDS = 2.0


class NetacctService:
    """Network accounting for one node (or one network namespace, given a `Host(netns=...)`)."""

    def __init__(self, config: NetacctConfig, registry: CollectorRegistry, pod_source: PodSource | None = None,
                 *, host: Host | None = None, settle_seconds: float = 0.2, backoff_initial: float = 1.0,
                 clock: Clock = SYSTEM_CLOCK, repair_check_seconds: float = REPAIR_CHECK_SECONDS,
                 first_pods_wait: float = FIRST_PODS_WAIT_SECONDS) -> None:
        self.config = config
        self.engine = Netacct(config, host)
        self.pods = pod_source if pod_source is not None else open_pod_source(config.pods_file)
        self.collector = NetacctCollector(self.engine, per_pod=config.per_pod_metrics)
        self.registry = registry
        self.settle_seconds = settle_seconds
        self.clock = clock
        self.backoff_initial = backoff_initial
        self.repair_check_seconds = repair_check_seconds
        self.first_pods_wait = first_pods_wait
        self.synced = asyncio.Event()  # set after each successful sync (tests and readiness)
        registry.register(self.collector)

    async def run(self, stop: asyncio.Event) -> None:
        """Sync as soon as the pods are known (or FIRST_PODS_WAIT_SECONDS have passed), then on every pod change
        and every sync interval, until `stop` is set."""
        source = asyncio.create_task(self.pods.run(stop), name="netacct-pods")
        backoff = Backoff(self.backoff_initial, max(self.backoff_initial, self.config.sync_interval_seconds))
        try:
            version, pods = self.pods.snapshot()
            if pods is None:
                await self._wait(stop, version, self.first_pods_wait)
            while not stop.is_set():
                version, pods = self.pods.snapshot()
                try:
                    await asyncio.to_thread(self.engine.sync, pods)
                except Exception as exc:  # one failure must not end accounting; the next round retries
                    wait = backoff.next()
                    log.error("netacct: sync failed, retrying in %.1f s: %s", wait, exc,
                              exc_info=not isinstance(exc, SyncError))
                else:
                    backoff.reset()
                    wait = self.config.sync_interval_seconds
                    self.synced.set()
                healthy = wait == self.config.sync_interval_seconds
                if await self._wait_or_repair(stop, version, wait, check=healthy):
                    await self.clock.wait(stop, self.settle_seconds)
        finally:
            await aio.cancel_and_wait(source)

    async def _wait_or_repair(self, stop: asyncio.Event, version: int, timeout: float, check: bool) -> bool:
        """`_wait`, ended early (False) when the repair check (`check`: not while a failed sync backs off) finds
        netacct's state changed by someone else."""
        deadline = self.clock.monotonic() + timeout
        while True:
            left = deadline - self.clock.monotonic()
            if left <= 0 or stop.is_set():
                return False
            if await self._wait(stop, version, min(left, self.repair_check_seconds)):
                return True
            if check and not stop.is_set() and await asyncio.to_thread(self.engine.needs_repair):
                return False

    async def _wait(self, stop: asyncio.Event, version: int, timeout: float) -> bool:
        """Wait for a pod change, `timeout` (on the clock) or stop; True when the pods changed."""
        woke = asyncio.Event()

        async def wake_on(waiting: Awaitable[object]) -> None:
            await waiting
            woke.set()

        watchers = [asyncio.create_task(wake_on(self.pods.wait_changed(version, FOREVER))),
                    asyncio.create_task(wake_on(stop.wait()))]
        try:
            await self.clock.wait(woke, timeout)
        finally:
            await aio.cancel_and_wait(*watchers)
        return self.pods.snapshot()[0] != version

    def close(self) -> None:
        """Unregister the collector and release sockets; rules and sets stay so counters survive a restart."""
        with contextlib.suppress(KeyError):
            self.registry.unregister(self.collector)
        self.engine.close()

    def cleanup(self) -> list[str]:
        """Remove every chain, rule and set netacct made (uninstall); returns what was removed."""
        removed = self.engine.remove_all()
        self.close()
        return removed
