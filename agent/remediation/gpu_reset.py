"""GPU reset, the first step of the escalation ladder: a GPU whose fault a reset cures is reset, once idle.

Which faults: those whose recovery (the driver's recovery-action field, or NVIDIA's Xid catalog bucket
RESET_GPU) is `gpu_reset` / `drain_and_reset`, at a severity that acts (isolate or more), and only when no fault
on the node needs a reboot (the reboot resets every GPU anyway). The catalog decides whether a reset is tried;
the configured action decides how far the node goes meanwhile (an isolated device, a cordon, a drain).

Advised resets: a GPU with a pending row remap (`NodeVerdict.reset_advised`) stays in service; with a reset command
it is reset once idle (no holder in a fresh PodResources reading, no NVML process), while the node has no fault of
its own (below cordon, nothing asking for a reboot) and after any fault's reset. There is no drain to wait for;
the GPU is Unhealthy only while its reset runs (health's `gpu_reset_starting`, then the reset observed, or
`gpu_reset_abandoned` when a pod took it at the last look), and the reset is routine maintenance, not counted
towards the latch. A GPU that cannot be reset here (MIG mode) keeps the advisory and nothing escalates.

When: once the drain the verdict asks for has finished (the isolated device's pods, or the node's), no pod holds
the GPU (PodResources) and NVML lists no process on it; until then it waits and says why (one Event per kind of
wait), looking again every `RECHECK_SECONDS`. One GPU at a time. Never on a latched node, never in dry-run (an
Event says what would run).

Then: the host's resetter closes the agent's NVML session, runs `gpuResetCommand`, opens the session and checks
NVML lists the GPU again. Success tells health (`gpu_reset_done`: findings that wait for a reset end, ECC baselines
restart), and the reset counts as verified when health stops asking for it within `gpuResetVerifySeconds`.
A failed reset, a fault that persists after it, or a GPU that cannot be reset at all (MIG mode, lost) escalates:
`escalation()` is a verdict `GpuResetFailed` with a reboot as recovery, so the node path cordons and, with a
reboot step configured, drains and hands the reboot on (`reboot`); without one the node stays cordoned.

Recorded on the node (`P/gpu-reset`: JSON with the boot id and, per GPU, running / ok / failed with time and
detail) so an agent restart repeats nothing: a reset recorded as running that no task of this process runs was
interrupted by the restart and counts as failed (its outcome is unknown). A new boot id means the node rebooted:
the record is dropped and health decides afresh. Each attempt counts towards the needs-a-human latch.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agent.clock import Clock
from agent.config.remediation import RemediationConfig
from agent.host.gpu_reset import ResetOutcome, ResetTarget
from agent.kube.model import format_time, parse_time
from agent.remediation import state
from agent.remediation.actions import NodeActions
from agent.remediation.events import WARNING, EventRecorder
from agent.remediation.metrics import ActionCounter
from agent.remediation.reboot import reboot_gpus
from agent.signals import GpuRecoveryAction, GpuResetListener, NodeVerdict, RecoveryRequest, Severity

log = logging.getLogger(__name__)

RESET_ACTIONS = frozenset({GpuRecoveryAction.GPU_RESET, GpuRecoveryAction.DRAIN_AND_RESET})
RECHECK_SECONDS = 15.0  # how often a waiting reset looks at the GPU's processes again (local NVML calls only)
ESCALATION_REASON = "GpuResetFailed"
RUNNING, OK, FAILED = "running", "ok", "failed"


def reset_gpus(verdict: NodeVerdict | None) -> list[str]:
    """GPUs the verdict asks to reset; [] below isolate or when a fault on the node needs a reboot."""
    if verdict is None or verdict.severity < Severity.ISOLATE or reboot_gpus(verdict):
        return []
    return sorted({r.gpu_uuid for r in verdict.recovery if r.action in RESET_ACTIONS})


def advised_resets(verdict: NodeVerdict | None) -> list[str]:
    """GPUs a reset would do good while idle (a pending remap); [] while the node itself has a fault (cordon or
    worse: the node path acts) or one that needs a reboot."""
    if verdict is None or verdict.severity >= Severity.CORDON or reboot_gpus(verdict):
        return []
    return sorted(set(verdict.reset_advised))


class Resetter(Protocol):
    """What this step asks of the host (`agent.host.gpu_reset.GpuResetter`)."""

    def target(self, uuid: str) -> ResetTarget | None:
        """Where NVML sees the GPU (blocking)."""

    def blockers(self, uuid: str) -> tuple[list[str], bool]:
        """What keeps the reset from running now, and whether waiting can help (blocking)."""

    async def reset(self, target: ResetTarget) -> ResetOutcome:
        """Run the reset."""


@dataclass
class ResetRecord:
    """`P/gpu-reset`: this boot's resets, per GPU UUID: {"state", "at", "detail"}."""

    boot: str
    gpus: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> ResetRecord:
        """ValueError for anything but the JSON this module writes."""
        data = json.loads(text)
        gpus = data.get("gpus") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(data.get("boot"), str) or not isinstance(gpus, dict) \
                or not all(isinstance(v, dict) and v.get("state") in (RUNNING, OK, FAILED) for v in gpus.values()):
            raise ValueError("not a GPU reset record")
        return cls(data["boot"], {str(k): {str(a): str(b) for a, b in v.items()} for k, v in gpus.items()})

    def dump(self) -> str:
        """Compact JSON for the annotation."""
        return json.dumps({"boot": self.boot, "gpus": self.gpus}, sort_keys=True, separators=(",", ":"))

    def with_gpu(self, uuid: str, state_: str | None, at: float = 0.0, detail: str = "") -> ResetRecord:
        """A copy with one GPU's entry set (None: removed)."""
        gpus = {k: v for k, v in self.gpus.items() if k != uuid}
        if state_ is not None:
            gpus[uuid] = {"state": state_, "at": format_time(at), "detail": detail[:300]}
        return ResetRecord(self.boot, gpus)

    def in_state(self, state_: str) -> list[str]:
        """The GPUs whose entry is in this state."""
        return sorted(uuid for uuid, entry in self.gpus.items() if entry["state"] == state_)


class GpuResets:
    """Starts, records and judges GPU resets; `escalation()` is what the node path acts on when one fails."""

    def __init__(self, config: RemediationConfig, *, resetter: Resetter | None, actions: NodeActions,
                 events: EventRecorder, clock: Clock, counter: ActionCounter, boot_id: Callable[[], str],
                 remediated: Callable[[str], Awaitable[None]], wake: Callable[[], None],
                 holders: Callable[[Sequence[str]], Awaitable[list[str] | None]],
                 drained: Callable[[NodeVerdict], bool], listener: GpuResetListener) -> None:
        self.config = config
        self.key = f"{config.prefix}/gpu-reset"
        self.resetter = resetter
        self._listener = listener  # health: Unhealthy while an advised reset runs, findings a reset ends
        self._actions = actions
        self._events = events
        self._clock = clock
        self._counter = counter
        self._boot_id = boot_id
        self._remediated = remediated
        self._wake = wake
        self._holders = holders
        self._drained = drained
        self._task: asyncio.Task[ResetOutcome] | None = None
        self._task_uuid = ""
        self._outcome: ResetOutcome | None = None  # the finished task's, until it is on the node
        self._waiting_since: float | None = None
        self._said: set[tuple[str, str]] = set()

    def record(self) -> ResetRecord:
        """This boot's record (empty when none, unreadable or from an earlier boot)."""
        boot = self._boot_id() or "unknown"
        text = self._actions.node.annotations.get(self.key, "")
        try:
            record = ResetRecord.parse(text) if text else ResetRecord(boot)
        except ValueError:
            return ResetRecord(boot)
        return record if record.boot == boot else ResetRecord(boot)

    def escalation(self) -> NodeVerdict | None:
        """A node verdict for the GPUs whose reset failed this boot; None when none did."""
        record = self.record()
        failed = record.in_state(FAILED) if self.resetter is not None else []
        if not failed:
            return None
        details = [f"{uuid}: {record.gpus[uuid].get('detail', '')}" for uuid in failed]
        severity = Severity.DRAIN if self.config.reboot_requests else Severity.CORDON
        return NodeVerdict(severity, ESCALATION_REASON, "GPU reset failed: " + "; ".join(details), tuple(failed),
                           hardware=True, reasons=tuple(details),
                           recovery=tuple(RecoveryRequest(u, GpuRecoveryAction.NODE_REBOOT) for u in failed))

    def next_due(self) -> float | None:
        """When a waiting reset looks again, or a reset's verify window ends."""
        if self.resetter is None:
            return None
        record = self.record()
        times = [t + self.config.gpu_reset_verify_seconds for u in record.in_state(OK)
                 if (t := parse_time(record.gpus[u].get("at"))) is not None]
        if self._waiting_since is not None:
            times.append(self._clock.now() + RECHECK_SECONDS)
        return min(times, default=None)

    async def reconcile(self, verdict: NodeVerdict | None, latched: bool) -> None:
        """Raises ApiError (the caller retries)."""
        if self.resetter is None:
            return
        await self._collect()
        await self._forget_stale()
        record = self.record()
        for uuid in record.in_state(RUNNING):
            if self._task_uuid != uuid:
                await self._failed(uuid, "the agent restarted while the reset ran; its outcome is unknown")
        if verdict is not None:
            await self._judge(verdict)
        self._waiting_since = None
        if self._task is None and not latched and verdict is not None:
            await self._start(verdict)

    async def _forget_stale(self) -> None:
        """Drop a record from an earlier boot (the node rebooted: health starts afresh) or one not readable."""
        text = self._actions.node.annotations.get(self.key, "")
        if not text:
            return
        boot = self._boot_id() or "unknown"
        try:
            stale = ResetRecord.parse(text).boot != boot
        except ValueError:
            log.warning("the node annotation %s is not a GPU reset record; removing it", self.key)
            stale = True
        if stale:
            await self._actions.apply("annotate", lambda n: state.annotate({self.key: None}))

    async def _judge(self, verdict: NodeVerdict) -> None:
        """Resets that worked: verified once health stops asking, failed if it still asks after the window."""
        record, now = self.record(), self._clock.now()
        asking = set(reset_gpus(verdict)) | set(verdict.reset_advised)
        for uuid in record.in_state(OK):
            at = parse_time(record.gpus[uuid].get("at")) or now
            if uuid not in asking and uuid not in verdict.devices:  # health no longer holds anything against it
                if await self._write(record.with_gpu(uuid, None)):
                    self._counter.count("gpu_reset", "verified")
                    await self._events.emit("GpuResetVerified", f"{uuid}: its checks pass after the reset; the "
                                            f"device is back in service")
            elif now >= at + self.config.gpu_reset_verify_seconds:
                await self._failed(uuid, f"still failing {self.config.gpu_reset_verify_seconds:.0f} s after the "
                                         f"reset: {verdict.describe()}")

    async def _start(self, verdict: NodeVerdict) -> None:
        assert self.resetter is not None
        record = self.record()
        candidates = [u for u in reset_gpus(verdict) if u not in record.gpus]
        advised = [u for u in advised_resets(verdict) if u not in record.gpus and ("cannot", u) not in self._said]
        if not candidates and not advised:
            return
        uuid = candidates[0] if candidates else advised[0]
        advisory = not candidates
        if not advisory and not self._drained(verdict):
            return self._wait(uuid, "drain", "")  # the drain's own Events say what it waits for
        if not await self._idle(uuid):
            return
        blockers, can_wait = await asyncio.to_thread(self.resetter.blockers, uuid)
        if blockers and can_wait:
            return await self._announce_wait(uuid, "nvml", "; ".join(blockers))
        if blockers and advisory:  # an advisory never escalates: the GPU keeps working as it is
            self._said.add(("cannot", uuid))
            await self._events.emit("GpuResetSkipped", f"{uuid}: a reset is advised ({verdict.describe()}) but "
                                    f"cannot run here: {'; '.join(blockers)}", WARNING)
            return
        if self._actions.dry_run:
            if ("dry_run", uuid) not in self._said:
                self._said.add(("dry_run", uuid))
                self._counter.count("gpu_reset", "dry_run")
                await self._events.emit("GpuResetDryRun", f"dry-run: would reset {uuid} with "
                                        f"{self.config.gpu_reset_command[0]} ({verdict.reason})")
            return
        if blockers:
            await self._failed(uuid, "cannot be reset: " + "; ".join(blockers))
            return
        target = await asyncio.to_thread(self.resetter.target, uuid)
        if target is None:
            await self._failed(uuid, "NVML no longer lists it")
            return
        if advisory:  # out of ListAndWatch first, then one more look: a pod admitted meanwhile keeps its GPU
            self._listener.gpu_reset_starting(uuid)
            if not await self._idle(uuid):
                self._listener.gpu_reset_abandoned(uuid)
                return
        if not await self._write(record.with_gpu(uuid, RUNNING, self._clock.now())):
            if advisory:
                self._listener.gpu_reset_abandoned(uuid)
            return
        why = "reset advised (a pending row remap or page retirement it applies)" if advisory else verdict.reason
        await self._events.emit("GpuResetStarted", f"{why}: resetting {uuid} ({target.bus_id}) with "
                                f"{self.config.gpu_reset_command[0]}; no process uses it", WARNING)
        if not advisory:  # routine maintenance is no remediation: it does not count towards the latch
            await self._remediated(f"GPU reset of {uuid} for {verdict.reason}")
        self._task_uuid = uuid
        self._task = asyncio.create_task(self.resetter.reset(target), name="remediation-gpu-reset")
        self._task.add_done_callback(lambda _task: self._wake())

    async def _idle(self, uuid: str) -> bool:
        """No pod holds the GPU by the kubelet's word now (not the last poll's); else wait and say why."""
        pods = await self._holders([uuid])
        if pods is None:
            await self._announce_wait(uuid, "pods", "which pods hold it cannot be read from the kubelet's "
                                                    "PodResources now")
        elif pods:
            await self._announce_wait(uuid, "pods", f"pods still hold it: {', '.join(pods)}")
        return pods == []

    def _wait(self, uuid: str, kind: str, why: str) -> None:
        self._waiting_since = self._clock.now()
        log.debug("GPU reset of %s waits (%s): %s", uuid, kind, why)

    async def _announce_wait(self, uuid: str, kind: str, why: str) -> None:
        self._wait(uuid, kind, why)
        if (kind, uuid) not in self._said:
            self._said.add((kind, uuid))
            await self._events.emit("GpuResetWaiting", f"{uuid}: the reset waits: {why}")

    async def _collect(self) -> None:
        """Record a finished reset's outcome. The task is dropped only once its outcome is on the node: a write the
        API server fails (ApiError: the caller retries) leaves both here for the next pass. Dropped before, the
        record said "running" for the rest of the boot: never verified, never escalated."""
        task = self._task
        if task is None or not task.done():
            return
        uuid = self._task_uuid
        if self._outcome is None:
            try:
                self._outcome = task.result()
            except Exception as exc:  # a bug in the reset path must not leave the GPU recorded as running
                log.exception("GPU reset of %s failed unexpectedly", uuid)
                self._outcome = ResetOutcome(False, f"{type(exc).__name__}: {exc}")
            if self._outcome.ok:  # before the record: health drops the findings a reset ends, and says so next;
                self._listener.gpu_reset_done(uuid)  # once, though the record's write may be retried
        outcome = self._outcome
        if not outcome.ok:
            await self._failed(uuid, outcome.detail)
        elif await self._write(self.record().with_gpu(uuid, OK, self._clock.now(), outcome.detail)):
            self._counter.count("gpu_reset", "ok")
            await self._events.emit("GpuReset", f"{uuid} was reset ({outcome.detail}); its checks must pass within "
                                    f"{self.config.gpu_reset_verify_seconds:.0f} s")
        self._task, self._task_uuid, self._outcome = None, "", None

    async def _failed(self, uuid: str, detail: str) -> None:
        if not await self._write(self.record().with_gpu(uuid, FAILED, self._clock.now(), detail)):
            return
        self._counter.count("gpu_reset", "failed")
        then = ("the node is drained and a reboot requested" if self.config.reboot_requests
                else "the node stays cordoned until it is repaired or rebooted (no reboot step is configured)")
        await self._events.emit(ESCALATION_REASON, f"{uuid}: {detail}; {then}", WARNING)

    async def _write(self, record: ResetRecord) -> bool:
        text = record.dump() if record.gpus else None
        return await self._actions.apply("annotate", lambda n: state.annotate({self.key: text}))

    async def close(self) -> None:
        """Wait for a running reset (the command is killed when its task is cancelled)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
