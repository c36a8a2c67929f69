"""Reboot requests: a fault that needs a reboot is handed to the cluster's own reboot tooling, never done here.

A verdict needs a reboot when a GPU's recovery is `node_reboot` / `system_reboot`: the NVIDIA driver asked for it
(NVML's recovery-action field) or NVIDIA's Xid catalog says so (RESTART_BM / RESTART_VM, e.g. Xid 79). Then,
once the agent owns a cordon on the node and the drain the verdict asks for has finished (or hit its deadline):

- the sentinel file (`rebootSentinelPath`) is created for kured, which reboots under its own lock, window and
  blockers. The cordon comes first on purpose: kured uncordons after the reboot only a node that was schedulable
  when it took its lock, so the node stays out until the agent's checks pass again;
- the NodeCondition `rebootConditionType` is set True for a NodeHealthCheck or Karpenter node-repair rule. Both
  time from `lastTransitionTime`, so the condition is set once and kept (heartbeats do not move it), and it goes
  False as soon as the node has rebooted — a stale True would make them act at once on a healthy node.

The request is recorded on the node (`P/reboot-requested`: the boot id and time), so an agent restart does not
ask twice; a different boot id later means the reboot happened: the record is removed, the condition goes
False, and health (which starts each boot afresh) decides again. Each request counts towards the
needs-a-human latch; a latched node gets no further requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from agent.clock import Clock
from agent.config.remediation import RemediationConfig
from agent.host.sentinel import write_sentinel
from agent.kube.model import format_time
from agent.remediation import state
from agent.remediation.actions import NodeActions
from agent.remediation.events import WARNING, EventRecorder
from agent.remediation.metrics import ActionCounter
from agent.remediation.state import Recorded
from agent.signals import GpuRecoveryAction, NodeVerdict, Severity

log = logging.getLogger(__name__)

REBOOT_ACTIONS = frozenset({GpuRecoveryAction.NODE_REBOOT, GpuRecoveryAction.SYSTEM_REBOOT})


def reboot_gpus(verdict: NodeVerdict | None) -> list[str]:
    """The GPUs whose recovery is a reboot (the driver's request or the Xid catalog's); [] when none."""
    if verdict is None:
        return []
    return [r.gpu_uuid for r in verdict.recovery if r.action in REBOOT_ACTIONS]


class RebootRequests:
    """Asks for a reboot once per boot and notices when it has happened."""

    def __init__(self, config: RemediationConfig, *, actions: NodeActions, events: EventRecorder, clock: Clock,
                 counter: ActionCounter, boot_id: Callable[[], str],
                 remediated: Callable[[str], Awaitable[None]]) -> None:
        self.config = config
        self.key = f"{config.prefix}/reboot-requested"
        self._actions = actions
        self._events = events
        self._clock = clock
        self._counter = counter
        self._boot_id = boot_id
        self._remediated = remediated
        self._failed_boot = ""  # the sentinel could not be written in this boot: said once, retried each pass

    async def reconcile(self, verdict: NodeVerdict | None, rec: Recorded, latched: bool) -> None:
        """Raises ApiError (the caller retries)."""
        if not self.config.reboot_requests:
            return
        boot = self._boot_id()
        record = self._actions.node.annotations.get(self.key, "")
        if record:
            if boot and record.split(" ", 1)[0] != boot:
                await self._rebooted(record)
            elif self.config.reboot_condition_type:  # keep it True (heartbeat only; the transition stays)
                current = self._actions.condition(self.config.reboot_condition_type)
                if current is not None and current.status == "True":
                    await self._actions.ensure_condition(True, current.reason, current.message,
                                                         self.config.reboot_condition_type)
            return
        gpus = reboot_gpus(verdict)
        if not gpus or verdict is None or latched or not rec.cordoned or verdict.severity < Severity.CORDON:
            return
        if verdict.severity is Severity.DRAIN and self.config.drain and rec.drain not in ("complete", "deadline"):
            return  # after the drain: kured would drain again, without our drain modes
        why = f"{verdict.reason}: {', '.join(gpus)} need a reboot ({verdict.describe()})"
        if self.config.reboot_sentinel_path and not await self._write(why, boot):
            return
        now = self._clock.now()
        if not await self._actions.apply("reboot_request", lambda n: state.annotate(
                {self.key: f"{boot or 'unknown'} {format_time(now)}"})):
            return
        if self.config.reboot_condition_type:
            await self._actions.ensure_condition(True, verdict.reason, why, self.config.reboot_condition_type)
        where = (f"created {self.config.reboot_sentinel_path} for kured" if self.config.reboot_sentinel_path
                 else f"set condition {self.config.reboot_condition_type}")
        await self._events.emit("RebootRequested", f"{why}; {where}", WARNING)
        await self._remediated(f"reboot request for {verdict.reason}")

    async def _write(self, why: str, boot: str) -> bool:
        path = self.config.reboot_sentinel_path
        if self._actions.dry_run:
            log.info("dry-run: would create the reboot sentinel %s (%s)", path, why)
            return True
        try:
            created = await asyncio.to_thread(write_sentinel, self.config.reboot_sentinel_dir, path,
                                              f"gpu-node-agent: {why}\n")
        except OSError as exc:
            self._counter.count("reboot_request", "failed")
            if self._failed_boot != boot:
                self._failed_boot = boot
                hint = " (is the host directory mounted?)" if isinstance(exc, FileNotFoundError) else ""
                await self._events.emit("RebootRequestFailed", f"cannot create the reboot sentinel {path}: "
                                        f"{exc}{hint}", WARNING)
            return False
        if not created:
            log.info("the reboot sentinel %s is already there (a regular file): left as it is, the request stands",
                     path)
        return True

    async def _rebooted(self, record: str) -> None:
        if not await self._actions.apply("annotate", lambda n: state.annotate({self.key: None})):
            return
        if self.config.reboot_condition_type:
            await self._actions.ensure_condition(False, "Rebooted", "the node rebooted after the agent's request",
                                                 self.config.reboot_condition_type)
        self._counter.count("reboot_request", "rebooted")
        await self._events.emit("RebootCompleted", f"the node rebooted (requested at boot {record})")
