"""`RemediationService`: owns the remediation loops and keeps API server trouble from ever crashing them.

Loops, all stopped by one stop event (blocked requests are cancelled): the verdict consumer, the node watch
(`agent.kube.reflector`: one watch by name, bookmarks, re-GET only on 410, backoff on errors), the reconcile
loop (runs the engine on every change and when its next timer is due), the maintenance poller and the
preflight checks when configured. If a loop fails with a bug, the supervisor
stops the others and re-raises the error to the caller; API errors are logged and retried with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from agent import aio
from agent.clock import Clock, SystemClock
from agent.config.remediation import RemediationConfig
from agent.host.kmsg import read_boot_id
from agent.kube.errors import ApiConflict, ApiError
from agent.kube.model import NodeView, WatchEvent
from agent.kube.port import Cluster
from agent.kube.reflector import MAX_BACKOFF, Reflector
from agent.remediation.actions import NodeActions
from agent.remediation.drain import Drainer
from agent.remediation.drainmodes import DrainPlanner
from agent.remediation.engine import Engine, Inputs
from agent.remediation.events import EventRecorder
from agent.remediation.gpu_reset import Resetter
from agent.remediation.isolate import PodsOf
from agent.remediation.maintenance import Fetch, MaintenanceWatcher, urllib_fetch
from agent.remediation.metrics import ActionCounter
from agent.remediation.preflight import PreflightCheck, run_preflight
from agent.remediation.slots import Slots
from agent.signals import GpuResetListener, Latest, NodeVerdict
from agent.supervisor import Backoff, RunFn, Supervisor

log = logging.getLogger(__name__)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"

MAX_IDLE = 3600.0
POD_EVENT_BURST = 110  # one DrainScheduled Event per pod: the kubelet admits at most 110 pods per node by default
# The node watch retries sooner than writes do: one cheap GET per node per minute at worst, and its first answer
# after an outage wakes the reconcile loop, so a pending cordon waits at most about this long once the API is back.
WATCH_MAX_BACKOFF = 60.0


def _newer(candidate: str, current: str) -> bool:
    """Best effort 'not older' for resourceVersions that are integers (etcd); opaque ones always pass."""
    try:
        return int(candidate) >= int(current)
    except ValueError:
        return True


class RemediationService:
    """Acts on this node's API objects from health verdicts (see `engine`).

    `verdicts` is the cell the health subsystem publishes its `agent.signals.NodeVerdict` into; only the latest
    matters, and there is none until health has looked once. `pods_of` names the pods holding devices
    (`agent.ownership`; None without PodResources); `reset_listener` is told about each GPU reset (health).
    """

    def __init__(self, config: RemediationConfig, node_name: str, cluster: Cluster,
                 verdicts: Latest[NodeVerdict], registry: CollectorRegistry, *, pod_name: str = "",
                 pod_namespace: str = "", clock: Clock | None = None, rng: random.Random | None = None,
                 preflight_checks: Sequence[PreflightCheck] = (), metadata_fetch: Fetch = urllib_fetch,
                 boot_id_path: str = BOOT_ID_PATH, resetter: Resetter | None = None, pods_of: PodsOf | None = None,
                 reset_listener: GpuResetListener | None = None) -> None:
        if not node_name:
            raise ValueError("remediation needs the node name: set --node-name or NODE_NAME (downward API)")
        self.config = config
        self.node_name = node_name
        self.cluster = cluster
        self.verdicts = verdicts
        self.clock = clock or SystemClock()
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self.counter = ActionCounter(registry)
        self._wake_event = asyncio.Event()
        self.inputs = Inputs()
        self._checks = list(preflight_checks)
        dry = config.dry_run
        self.actions = NodeActions(cluster, self.clock, self.counter, condition_type=config.condition_type,
                                   heartbeat_seconds=config.condition_heartbeat_seconds, dry_run=dry)
        self.events = EventRecorder(cluster, self.clock, dry_run=dry)
        self.slots = Slots(cluster, self.clock, self.counter, namespace=config.lease_namespace(),
                           count=config.slots, holder=node_name, lease_seconds=config.slot_lease_seconds,
                           label=f"{config.prefix}/remediation-slot", dry_run=dry)
        # pod Events (one per pod per drain, only while draining) have their own bucket so that a node full of
        # pods cannot starve the node's own Events
        self.pod_events = EventRecorder(cluster, self.clock, dry_run=dry, burst=POD_EVENT_BURST)
        drainer = Drainer(cluster, self.clock, self.events, self.counter, own_pod=(pod_namespace, pod_name),
                          planner=DrainPlanner(config), pod_events=self.pod_events,
                          backoff_seconds=config.eviction_backoff_seconds,
                          backoff_max_seconds=config.eviction_backoff_max_seconds,
                          blocked_retry_seconds=config.eviction_blocked_retry_seconds, dry_run=dry)
        self.engine = Engine(config, actions=self.actions, slots=self.slots, events=self.events, drainer=drainer,
                             clock=self.clock, counter=self.counter, inputs=self.inputs, wake=self.wake,
                             jitter=self._jitter,
                             # read once: a reboot ends this process, so the next one reads the new id
                             boot_id=read_boot_id(boot_id_path) if config.reboot_requests or resetter else "",
                             resetter=resetter, pods_of=pods_of, reset_listener=reset_listener)
        self.maintenance = (MaintenanceWatcher(list(config.maintenance_clouds), config.maintenance_base_url,
                                               self.clock, poll_seconds=config.maintenance_poll_seconds,
                                               drain_before=config.maintenance_drain_before_seconds,
                                               fetch=metadata_fetch)
                            if config.maintenance_clouds else None)

    def _jitter(self) -> float:
        return self._rng.uniform(0.8, 1.2)

    def _backoff(self) -> Backoff:
        return Backoff(1.0, MAX_BACKOFF, jitter=0.2, rng=self._rng)

    def wake(self) -> None:
        """Ask the reconcile loop to run now."""
        self._wake_event.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set; re-raises a loop's unexpected error after stopping the others."""
        if not await self._start(stop):
            return
        loops: list[tuple[str, RunFn]] = [("reconcile", self._reconcile_loop), ("verdicts", self._verdict_loop),
                                          ("node watch", self._watch_loop), ("relay", self._relay)]
        if self.maintenance is not None:
            loops.append(("maintenance", self._maintenance_loop))
        if self.inputs.preflight.active:
            loops.append(("preflight", self._preflight_loop))
        supervisor = Supervisor(stop, clock=self.clock, grace=0.0)  # blocked requests are cancelled at stop
        for name, loop in loops:
            supervisor.add(f"remediation {name}", loop, restart=False)
        try:
            await supervisor.run()
        finally:
            await self.engine.close()

    async def _preflight_loop(self, stop: asyncio.Event) -> None:
        await run_preflight(self._checks, self.inputs.preflight, self.clock, stop=stop,
                            retry_seconds=self.config.preflight_retry_seconds, changed=self.wake)

    async def _relay(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake_event.set()

    async def _start(self, stop: asyncio.Event) -> bool:
        """Read the node (retrying), then pick up where a previous agent left off."""
        backoff = self._backoff()
        while not stop.is_set():
            try:
                node = await self.actions.refresh()
                break
            except ApiError as exc:
                wait = backoff.next()
                log.warning("cannot read node %s: %s; retrying in %.0fs", self.node_name, exc, wait)
                await self.clock.wait(stop, wait)
        else:
            return False
        key = self.config.preflight_taint
        self.inputs.preflight.active = bool(key) and node.taint(key) is not None
        rec = self.engine.recorded()
        if rec.cordoned:
            log.info("resuming: the agent's cordon for %s is recorded on node %s", rec.reason, node.name)
            with contextlib.suppress(ApiError):
                if await self.slots.find_own() is None:
                    log.warning("resuming without a remediation slot; the cordon stays")
        if self.config.dry_run:
            log.info("dry-run: decisions are logged and sent as Events; nothing else changes")
        return True

    async def _verdict_loop(self, stop: asyncio.Event) -> None:
        seen = 0
        while not stop.is_set():
            newer = asyncio.ensure_future(self.verdicts.wait_newer(seen))
            await aio.wait_any(stop, newer)
            if newer.cancelled():
                return  # stop won
            seen, verdict = newer.result()  # the latest: verdicts published meanwhile are superseded
            if verdict != self.inputs.health:
                log.info("verdict %s (%s): %s", verdict.verdict, verdict.reason, verdict.describe())
                self.inputs.health = verdict
                self.wake()

    async def _maintenance_loop(self, stop: asyncio.Event) -> None:
        assert self.maintenance is not None

        def changed() -> None:
            self.inputs.maintenance = self.maintenance.verdict if self.maintenance else None
            self.wake()
        await self.maintenance.run(stop, changed)

    async def _reconcile_loop(self, stop: asyncio.Event) -> None:
        backoff = self._backoff()
        conflicts = 0
        while not stop.is_set():
            self._wake_event.clear()
            try:
                await self.engine.reconcile()
            except ApiConflict:
                conflicts += 1
                log.info("node changed under us; deciding again from the fresh node")
                timeout = 0.0 if conflicts < 3 else backoff.delay
            except ApiError as exc:
                self.counter.count("reconcile", "api_error")
                timeout = backoff.next()
                log.warning("remediation step failed: %s; retrying in %.0fs", exc, timeout)
            else:
                backoff.reset()
                conflicts = 0
                due = self.engine.next_due()
                timeout = MAX_IDLE if due is None else max(1.0, due - self.clock.now())
            if timeout > 0:
                await self.clock.wait(self._wake_event, min(timeout, MAX_IDLE))

    async def _watch_loop(self, stop: asyncio.Event) -> None:
        """The node, by name, through the shared reflector loop; a 410 reads the node again and reconciles, and so
        does the first read after a failed watch: its answer is the news that the API server is back."""
        async def reread() -> str:
            node = await self.actions.refresh()
            self.wake()
            return node.resource_version

        def apply(event: WatchEvent[NodeView]) -> None:
            if event.type == "DELETED":
                log.error("node %s was deleted", self.node_name)
            elif event.object is not None:
                self._observe(event.object)

        reflector: Reflector[NodeView] = Reflector(
            f"node {self.node_name}", reread, self.cluster.watch_node, apply, log=log, clock=self.clock,
            version=self.actions.node.resource_version, rng=self._rng, relist_after_error=True,
            backoff=Backoff(1.0, WATCH_MAX_BACKOFF, jitter=0.2, rng=self._rng))
        await reflector.run(stop)

    def _observe(self, node: NodeView) -> None:
        before = self.actions.node
        if not _newer(node.resource_version, before.resource_version):
            return
        self.actions.observe(node)
        after = self.actions.node
        condition = self.config.condition_type
        if (before.unschedulable, before.taints, before.annotations, before.conditions.get(condition)) != (
                after.unschedulable, after.taints, after.annotations, after.conditions.get(condition)):
            self.wake()

