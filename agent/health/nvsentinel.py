"""Health findings to NVSentinel: each new finding and each recovery as a `HealthEvent` to its platform connector.

The agent acts as one of NVSentinel's health monitors (a client of the connector's unix socket). The verdict book's
publisher hands every change of the active findings to `observe` (synchronous, never blocking): a finding that is
new, or changed its code, devices or severity, becomes an unhealthy event, one that ended a healthy one (a
recovery). Events wait in a bounded queue (`QUEUE_SIZE`; full: dropped and counted), and `run` sends them in batches,
each call abandoned at `CALL_TIMEOUT`: a connector that hangs or is gone costs the sender its deadlines and nothing
else; health, the device plugin and remediation never wait on it. Failed batches are counted, not retried:
NVSentinel's own monitors re-evaluate on their next poll the same way (#1259).

Mapping (docs/fleet.md): `agent` gpu-node-agent; `componentClass` GPU or NIC; `checkName` the finding's code without
its number (`GpuXid`), `errorCode` the number (`79`) or the code; the GPU as `GPU_UUID` and `PCI` entities, a NIC as
`PCI` (and its RDMA device as `NIC`); `recommendedAction` the driver's requested recovery when it said one, else by
severity (isolate: COMPONENT_RESET, cordon and drain: RESTART_BM, degraded: NONE); `isFatal` = action != NONE;
`processingStrategy` STORE_ONLY unless configured (the agent remediates by itself).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from agent import aio
from agent.health.findings import Finding
from agent.host.nvsentinel import Entity, HealthEventData, NvsentinelError, NvsentinelPort
from agent.signals import GpuRecoveryAction, Severity
from agent.topology.model import Topology

log = logging.getLogger(__name__)

AGENT = "gpu-node-agent"
QUEUE_SIZE = 256  # events; a connector gone for a long burst loses the oldest news past this, counted as dropped
BATCH = 32  # events per call at most
CALL_TIMEOUT = 5.0  # seconds per call: NVSentinel's own sink uses 10 s; a node-local socket answers in ms
_CODE = re.compile(r"^(.*?)(\d+)$")
_RECOVERY = {GpuRecoveryAction.GPU_RESET: "COMPONENT_RESET", GpuRecoveryAction.DRAIN_AND_RESET: "COMPONENT_RESET",
             GpuRecoveryAction.BUS_RESET: "COMPONENT_RESET", GpuRecoveryAction.NODE_REBOOT: "RESTART_BM",
             GpuRecoveryAction.SYSTEM_REBOOT: "RESTART_BM"}


def recommended_action(finding: Finding) -> str:
    """NVSentinel's RecommendedAction name for a finding."""
    if finding.recovery is not None and finding.recovery in _RECOVERY:
        return _RECOVERY[finding.recovery]
    if finding.severity >= Severity.CORDON:
        return "RESTART_BM"
    return "COMPONENT_RESET" if finding.severity is Severity.ISOLATE else "NONE"


class NvsentinelReporter:
    """Findings in (`observe`), events out (`run`), outcomes counted."""

    def __init__(self, port: NvsentinelPort, *, node_name: str, processing_strategy: str,
                 registry: CollectorRegistry, topology: Callable[[], Topology],
                 clock: Callable[[], float] = time.time, queue_size: int = QUEUE_SIZE,
                 call_timeout: float = CALL_TIMEOUT) -> None:
        self.port = port
        self.node_name = node_name
        self.strategy = processing_strategy
        self.topology = topology
        self.clock = clock
        self.call_timeout = call_timeout
        self.queue: asyncio.Queue[HealthEventData] = asyncio.Queue(maxsize=queue_size)
        self.outcomes = Counter("gpu_node_agent_nvsentinel_events", "Health events for NVSentinel's platform "
                                "connector by outcome: sent, failed (the call failed or passed its deadline), "
                                "dropped (the queue was full)", ("outcome",), registry=registry)
        for outcome in ("sent", "failed", "dropped"):
            self.outcomes.labels(outcome)
        self._active: dict[str, Finding] = {}
        self._last_error = ""

    def observe(self, findings: Sequence[Finding]) -> None:
        """The active findings now (from the publisher, on every change): queue what is new and what ended."""
        current = {f.key: f for f in findings}
        for key, finding in current.items():
            old = self._active.get(key)
            if old is None or (old.code, old.devices, old.severity) != (finding.code, finding.devices,
                                                                      finding.severity):
                self._offer(self.event(finding, healthy=False))
        for key, old in self._active.items():
            if key not in current:
                self._offer(self.event(old, healthy=True))
        self._active = current

    def _offer(self, event: HealthEventData) -> None:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.outcomes.labels("dropped").inc()

    def event(self, finding: Finding, *, healthy: bool) -> HealthEventData:
        """The HealthEvent of a finding (`healthy`: its recovery)."""
        entities = self._entities(finding)
        kinds = {e.kind for e in entities}
        component = "GPU" if "GPU_UUID" in kinds or finding.code.startswith("Gpu") else \
            "NIC" if "NIC" in kinds or finding.code.startswith("Nic") else "NODE"
        match = _CODE.match(finding.code)
        check, code = (match.group(1), match.group(2)) if match and match.group(1) else (finding.code, finding.code)
        action = "NONE" if healthy else recommended_action(finding)
        return HealthEventData(
            agent=AGENT, component_class=component, check_name=check, is_healthy=healthy,
            message=(f"recovered: {finding.reason}" if healthy else finding.reason)[:1024],
            recommended_action=action, error_codes=(code,), entities=entities, generated_at=self.clock(),
            node_name=self.node_name, processing_strategy=self.strategy,
            metadata={"severity": finding.severity.value, "hardware": str(finding.hardware).lower()})

    def _entities(self, finding: Finding) -> tuple[Entity, ...]:
        topology = self.topology()
        gpus = {gpu.uuid: gpu.bus_id for gpu in topology.gpus if gpu.uuid}
        nics = {nic.bus_id: nic.rdma or "" for nic in topology.nics}
        nics.update({vf.bus_id: nic.rdma or "" for nic in topology.nics for vf in nic.vfs})
        found: list[Entity] = []
        for device in finding.devices or ((finding.gpu_uuid,) if finding.gpu_uuid else ()):
            if device in gpus:
                found += [Entity("GPU_UUID", device), Entity("PCI", gpus[device])]
            elif device in nics:
                found += [Entity("PCI", device)] + ([Entity("NIC", nics[device])] if nics[device] else [])
            else:  # a MIG device or one the topology does not know (yet): its id as the agent knows it
                found.append(Entity("GPU_UUID" if device.startswith(("GPU-", "MIG-")) else "PCI", device))
        return tuple(dict.fromkeys(found))

    async def run(self, stop: asyncio.Event) -> None:
        """Send queued events in batches until `stop`; each call bounded by the deadline."""
        try:
            while not stop.is_set():
                getting = asyncio.ensure_future(self.queue.get())
                await aio.wait_any(stop, getting)
                if getting.cancelled():
                    return
                batch = [getting.result()]
                while len(batch) < BATCH and not self.queue.empty():
                    batch.append(self.queue.get_nowait())
                sending = asyncio.ensure_future(self._send(batch))
                await aio.wait_any(stop, sending)
                if sending.cancelled():  # stopping: a call in flight is abandoned, not waited for
                    return
        finally:
            await self.port.aclose()

    async def _send(self, batch: list[HealthEventData]) -> None:
        try:  # the port's own deadline, and ours over it: a port that ignored its deadline still lets go
            await asyncio.wait_for(self.port.send(batch, self.call_timeout), self.call_timeout + 1.0)
        except (NvsentinelError, TimeoutError) as exc:
            self.outcomes.labels("failed").inc(len(batch))
            problem = exc.reason if isinstance(exc, NvsentinelError) else "timeout"
            if problem != self._last_error:
                log.warning("NVSentinel's connector did not take %d health event(s) (%s); they are counted as "
                            "failed and not retried", len(batch), exc or problem)
            self._last_error = problem
            return
        self._last_error = ""
        self.outcomes.labels("sent").inc(len(batch))
