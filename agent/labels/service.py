"""Node labels, kept current: read the facts, compute the labels, publish once per change, never blink.

The labels come in groups, one per source: GFD's keys (NVML facts, machine type, vGPU scan), the topology's,
the NIC rate (RDMA port files), `gpu.expected` and `gpu.healthy` (device health). A group whose source fails
keeps the value it last had (read back from what is published after a restart), so a failing NVML never writes
`0` or drops a key; the first write waits until every group that must be there has a value (a restart never
publishes a partial set); a write happens only when the wanted set differs from what is published (steady state:
no request at all), and a health change is published at once (after `SETTLE` seconds that gather the flips of
one event into one write). Nothing is deleted on exit.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from agent import aio
from agent.clock import SYSTEM_CLOCK, Clock
from agent.kube.errors import ApiConflict, ApiError
from agent.labels import own
from agent.labels.facts import FactReader, Reading
from agent.labels.gfd import PREFIX
from agent.labels.publish import Target
from agent.signals import DeviceHealth

log = logging.getLogger(__name__)

SETTLE = 0.5  # seconds: one fault flips a GPU and its MIG devices in a burst; one write for all of them
GROUPS = ("gfd", "topology", "rate", "expected", "healthy")
BLOCKING = ("gfd", "healthy")  # the first write waits for these


_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def valid(key: str, value: str) -> bool:
    """A label the API server accepts: `prefix/name` with a name of at most 63 characters, a value of at most 63
    (alphanumerics, `-_.` inside), as apimachinery's validation checks them."""
    name = key.rpartition("/")[2]
    return len(name) <= 63 and _NAME.fullmatch(name) is not None and len(value) <= 63 and \
        _VALUE.fullmatch(value) is not None


def group_of(key: str) -> str:
    """Which source a published key belongs to."""
    if key.startswith(PREFIX):
        return "gfd"
    return {own.NIC_RATE: "rate", own.GPU_EXPECTED: "expected", own.GPU_HEALTHY: "healthy"}.get(key, "topology")


@dataclass
class Settings:
    """How often the facts are read, and GFD's presence looked for."""

    interval: float = 30.0
    gfd_interval: float = 300.0


class NodeLabelService:
    """The loop: `run` until stopped; `metrics` counts writes by outcome."""

    def __init__(self, reader: FactReader, device_health: DeviceHealth, registry: CollectorRegistry, *,
                 settings: Settings | None = None, health_ready: asyncio.Event | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.reader, self.device_health = reader, device_health
        self.target: Target | None = None
        self.settings = settings or Settings()
        self.health_ready = health_ready
        self.clock = clock
        self.writes = Counter("gpu_node_agent_node_label_writes", "Writes of the node labels (NodeFeature or Node)",
                              ("outcome",), registry=registry)
        self.last: dict[str, dict[str, str]] = {}  # group -> its last known labels
        self.published: dict[str, str] | None = None  # what the target holds, None until read
        self.healthy = own.HealthyGpus()
        self._reading: Reading | None = None
        self._waiting_logged = ""
        self._invalid_logged: set[str] = set()

    # --- computing --------------------------------------------------------------------------------------------

    def _health_group(self) -> dict[str, str] | None:
        if self.health_ready is not None and not self.health_ready.is_set():
            return None
        topology = self.reader.topology()
        count = self.healthy.count(topology.gpus, self.device_health.unhealthy().keys(),
                                   self.device_health.unknown())
        return None if count is None else {own.GPU_HEALTHY: str(count)}

    def wanted(self, reading: Reading) -> dict[str, str] | None:
        """The labels to publish, or None while a blocking group has never had a value."""
        groups: dict[str, dict[str, str] | None] = {**reading.groups, "healthy": self._health_group()}
        labels: dict[str, str] = {}
        missing = []
        for group in GROUPS:
            value = groups.get(group)
            if value is not None:
                self.last[group] = value
            elif group not in self.last and self.published is not None:
                seeded = {k: v for k, v in self.published.items() if group_of(k) == group}
                if seeded or group not in BLOCKING:
                    self.last[group] = seeded  # what an earlier run published stands until the source answers
            if group in self.last:
                labels.update(self.last[group])
            elif group in BLOCKING:
                missing.append(f"{group} ({reading.why.get(group, 'not read yet')})")
        for key in [k for k, v in labels.items() if not valid(k, v)]:
            # one bad value (a machine type longer than 63 characters) must not stop every other label
            bad = labels.pop(key)
            if key not in self._invalid_logged:
                self._invalid_logged.add(key)
                log.warning("node label %s=%r is not a valid label: left out", key[:100], bad[:100])
        if missing:
            text = "; ".join(missing)
            if text != self._waiting_logged:
                log.info("node labels: waiting for a complete first reading: %s", text)
                self._waiting_logged = text
            return None
        return labels

    # --- publishing -------------------------------------------------------------------------------------------

    async def publish(self, labels: Mapping[str, str]) -> None:
        """Write when different; a conflict is read again and retried once."""
        assert self.target is not None
        for attempt in (1, 2):
            try:
                if await self.target.write(labels):
                    self.writes.labels(outcome="ok").inc()
                    log.info("node labels published on the %s: %d keys", self.target.mode, len(labels))
                self.published = dict(labels)
                return
            except ApiConflict:
                self.writes.labels(outcome="conflict").inc()
                if attempt == 2:
                    return
            except ApiError as exc:
                self.writes.labels(outcome="error").inc()
                log.warning("node labels not published (%s); retried at the next change or reading", exc)
                return

    async def _read_published(self) -> bool:
        assert self.target is not None
        try:
            self.published = await self.target.read()
        except ApiError as exc:
            log.warning("node labels: cannot read what is published on the %s (%s); retrying", self.target.mode,
                        exc)
            return False
        return True

    async def step(self, *, full: bool) -> None:
        """One pass: read the facts (`full`) or only health, and publish what changed."""
        if self.published is None and not await self._read_published():
            return
        if full or self._reading is None:
            self._reading = await self.reader.read()
        labels = self.wanted(self._reading)
        if labels is not None and labels != self.published:
            await self.publish(labels)

    async def run(self, stop: asyncio.Event, target: Target) -> None:
        """Publish on `target` until `stop`: a full pass every interval, a health pass as soon as device health
        changes."""
        if target is not self.target:
            self.target, self.published = target, None
        seen = self.device_health.version
        full_at = 0.0
        while not stop.is_set():
            now = self.clock.monotonic()
            full = now >= full_at
            if full:
                full_at = now + self.settings.interval
            await self.step(full=full)
            health = asyncio.ensure_future(self.device_health.wait_newer(seen))
            # also wake when health's first verdicts are in
            ready = self.health_ready if self.health_ready is not None and not self.health_ready.is_set() else None
            await aio.wait_any(stop, health, *((ready,) if ready is not None else ()),
                               timeout=max(0.0, full_at - self.clock.monotonic()))
            if not health.cancelled() or (ready is not None and ready.is_set()):
                await self.clock.wait(stop, SETTLE)
                seen = self.device_health.version
