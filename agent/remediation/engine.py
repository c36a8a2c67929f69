"""The remediation decisions: from the latest verdicts and the node as recorded, what to change, once.

`reconcile()` is level-triggered: it reads the ownership annotations (`state.Recorded`), compares them with
the most severe of the health and maintenance verdicts, and makes only the missing changes, so running it
again, or in a restarted agent, repeats nothing. The rules, from the failures of earlier tools:

- cordon only while holding a slot (no slot: condition + `RemediationDeferred` Event, retry later);
- an admin uncordon of our cordon is final for that fault: the agent drops its taint and ownership and does
  not cordon again until a different fault, or the same one after a healthy window (draino#17);
- uncordon only our own cordon, after `healthy_window_seconds` of health, when the policy allows the reason
  (hardware faults stay by default); never touch an admin's `spec.unschedulable` (drainsafe#1);
- a drain stops as soon as the verdict no longer asks for it (draino#50); it runs in a task of its own
  (`node_drain`), whose outcome the next pass records;
- a fault that needs a reboot is handed to kured (sentinel file) and/or NHC/Karpenter (a NodeCondition) after
  the cordon and the drain, once per boot (`reboot`);
- a condition type the agent set once but no longer sets is removed at start (`conditions`);
- an `isolate` verdict drains only the pods holding that one device and leaves the node schedulable
  (`isolate`); the condition stays False and names the device;
- a GPU whose fault a reset cures is reset once idle (`gpu_reset`); a failed reset is an escalation verdict
  (`GpuResetFailed`, recovery a reboot) that the node path acts on like any other;
- every cordon is stamped into the remediation history; the `latchCount`-th within the window latches the node
  `NeedsHumanAttention` (`latch`): no automatic uncordon until a person removes the latch annotation;
- each new fault finding (a reason on a device) is an incident, recorded in `<prefix>/incidents` in the same
  nodes/status write that changes the condition (`incidents`), never in a request of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agent.clock import Clock
from agent.config.remediation import RemediationConfig
from agent.kube.model import format_time
from agent.remediation import incidents, latch, state
from agent.remediation.actions import NodeActions
from agent.remediation.conditions import forget_stale_conditions, owned_types
from agent.remediation.drain import Drainer
from agent.remediation.events import WARNING, EventRecorder
from agent.remediation.gpu_reset import ESCALATION_REASON, GpuResets, Resetter
from agent.remediation.isolate import Isolation, PodsOf
from agent.remediation.metrics import ActionCounter
from agent.remediation.node_drain import OVER, NodeDrain
from agent.remediation.preflight import PreflightState
from agent.remediation.reboot import RebootRequests
from agent.remediation.slots import Slots
from agent.remediation.state import Keys, Recorded
from agent.signals import GpuResetListener, NodeVerdict, NoResetListener, Severity, worst

log = logging.getLogger(__name__)


def may_uncordon(config: RemediationConfig, reason: str, hardware: bool) -> tuple[bool, str]:
    """Whether policy lets the agent lift its own cordon for this reason, and why."""
    if reason in config.uncordon_deny_reasons:
        return False, f"{reason} is listed in uncordonDenyReasons"
    if reason in config.uncordon_allow_reasons:
        return True, f"{reason} is listed in uncordonAllowReasons"
    if config.uncordon_policy == "never":
        return False, "uncordonPolicy is never"
    if config.uncordon_policy == "non-hardware" and hardware:
        return False, f"{reason} is a hardware fault (uncordonPolicy non-hardware)"
    return True, f"uncordonPolicy {config.uncordon_policy}"


@dataclass
class Inputs:
    """What the engine decides from, fed by the service's loops."""

    health: NodeVerdict | None = None
    maintenance: NodeVerdict | None = None
    escalation: NodeVerdict | None = None  # the ladder's own: a failed GPU reset
    preflight: PreflightState = field(default_factory=PreflightState)

    def effective(self) -> NodeVerdict | None:
        """The most severe verdict (an escalation wins a tie, then health)."""
        return worst(self.escalation, self.health, self.maintenance)


class Engine:
    """Decides and acts; the service calls `reconcile()` on every change and when `next_due()` passes."""

    def __init__(self, config: RemediationConfig, *, actions: NodeActions, slots: Slots, events: EventRecorder,
                 drainer: Drainer, clock: Clock, counter: ActionCounter, inputs: Inputs, wake: Callable[[], None],
                 jitter: Callable[[], float] = lambda: 1.0, boot_id: str = "",
                 resetter: Resetter | None = None, pods_of: PodsOf | None = None,
                 reset_listener: GpuResetListener | None = None) -> None:
        self.config = config
        # pods_of: device IDs -> the pods holding them ("namespace/name"), from agent.ownership: named in the
        # condition message, and the pods an isolation drains
        self.isolation = Isolation(config, actions=actions, events=events, drainer=drainer, clock=clock,
                                   counter=counter, wake=wake, pods_of=pods_of)
        self.reboot = RebootRequests(config, actions=actions, events=events, clock=clock, counter=counter,
                                     boot_id=lambda: boot_id, remediated=self.remediated)
        self.gpu_resets = GpuResets(config, resetter=resetter if config.gpu_resets else None, actions=actions,
                                    events=events, clock=clock, counter=counter, boot_id=lambda: boot_id,
                                    remediated=self.remediated, wake=wake, holders=self._reset_holders,
                                    drained=self._drained_for_reset,
                                    listener=reset_listener if reset_listener is not None else NoResetListener())
        self.keys = Keys.for_prefix(config.prefix)
        self.latch_keys = latch.LatchKeys.for_prefix(config.prefix)
        self.actions = actions
        self.slots = slots
        self.events = events
        self.drainer = drainer
        self.clock = clock
        self.counter = counter
        self.inputs = inputs
        self._wake = wake
        self._jitter = jitter
        self.deferred_until: float | None = None
        self.node_drain = NodeDrain(config, actions=actions, drainer=drainer, clock=clock, keys=self.keys,
                                    wanted=self._drain_wanted, wake=wake)
        self._had_verdict = False  # a verdict was seen in this process (None after one means every source cleared)
        self._said: set[tuple[str, str]] = set()  # (what, reason) already announced, to avoid repeating Events
        self._conditions_checked = False  # stale condition types removed (once per process)
        self._findings: frozenset[tuple[str, str]] = frozenset()  # (reason, device) already recorded as incidents

    def recorded(self) -> Recorded:
        """The decisions recorded on the node."""
        return Recorded.from_node(self.actions.node, self.keys)

    async def reconcile(self) -> None:
        """Make the node match the decisions; raises ApiError (the caller backs off and calls again)."""
        await self.node_drain.collect()
        if not self._conditions_checked and (self.inputs.effective() is not None or self.inputs.preflight.active):
            # before this process first writes a condition (nothing at all is written before the first verdict)
            await forget_stale_conditions(self.actions, self.events, f"{self.config.prefix}/condition-types",
                                          owned_types(self.config.condition_type, self.config.reboot_condition_type))
            self._conditions_checked = True
        rec = self.recorded()
        node = self.actions.node
        if rec.cordoned and (not node.unschedulable or node.taint(self.keys.taint) is None):
            await self._admin_uncordoned(rec)
        await self._preflight()
        verdict = self.inputs.effective()
        await self._latch_cleared(verdict)
        latched = latch.latched(self.actions.node, self.latch_keys)
        self.counter.latched(latched)
        self.inputs.escalation = self.gpu_resets.escalation()
        verdict = self.inputs.effective()
        if verdict is not None and verdict.severity >= Severity.CORDON:
            await self._fault(verdict)
        elif verdict is not None and not latched:  # latched: no uncordon, whatever the checks say
            await self._not_faulty(verdict)
        await self.isolation.reconcile(verdict)
        await self.reboot.reconcile(verdict, self.recorded(), latched)
        await self.gpu_resets.reconcile(self.inputs.health, latched)  # after the drains it waits for
        if self.gpu_resets.escalation() != self.inputs.escalation:
            self._wake()  # a reset failed: the node path acts on it in the next pass
        await self._condition(verdict)
        if self.recorded().cordoned:
            await self.slots.renew()
        elif self.slots.held is not None and self.deferred_until is None:
            await self.slots.release()

    def next_due(self) -> float | None:
        """The next time `reconcile` has timed work (heartbeat, healthy window, slot retry or renewal)."""
        times = [self.slots.renew_due_at(), self.deferred_until, self.gpu_resets.next_due()]
        if self.inputs.effective() is not None or self.inputs.preflight.failure:
            times.append(self.actions.heartbeat_due_at())
        rec = self.recorded()
        if rec.healthy_since is not None:
            times.append(rec.healthy_since + self.config.healthy_window_seconds)
        now = self.clock.now()
        return min((t for t in times if t is not None and t > now), default=None)

    async def _say(self, what: str, reason: str, message: str, kind: str = "Normal") -> None:
        if (what, reason) not in self._said:
            self._said.add((what, reason))
            await self.events.emit(what, message, kind)

    async def _admin_uncordoned(self, rec: Recorded) -> None:
        await self.actions.apply("admin_uncordon", lambda n: state.admin_override_patch(n, self.keys, rec.reason))
        self.node_drain.stop()
        await self.events.emit("AdminUncordonRespected", f"the node was uncordoned by someone else while {rec.reason} "
                               f"was recorded; the agent will not cordon it again for this fault")
        await self.slots.release()

    async def _preflight(self) -> None:
        pre = self.inputs.preflight
        key = self.config.preflight_taint
        if not pre.active:
            return
        if pre.failure:
            await self._say("PreflightFailed", pre.failure, f"preflight checks failed, keeping taint {key}: "
                            f"{pre.failure}", WARNING)
        elif pre.passed:
            if await self.actions.apply("preflight", lambda n: state.remove_taint_patch(n, key)):
                await self.events.emit("PreflightPassed", f"preflight checks passed; removed taint {key}")
            pre.active = False

    async def _fault(self, verdict: NodeVerdict) -> None:
        rec = self.recorded()
        now = self.clock.now()
        if rec.override_reason == verdict.reason:
            if ("override", verdict.reason) not in self._said:
                self._said.add(("override", verdict.reason))
                log.info("not cordoning for %s: an admin uncordoned this node for that fault", verdict.reason)
            return
        if not rec.cordoned:
            if self.deferred_until is not None and now < self.deferred_until:
                return
            slot = await self.slots.acquire()
            if slot is None:
                self.deferred_until = now + self.config.slot_retry_seconds * self._jitter()
                self.counter.count("cordon", "deferred")
                await self.events.emit(state.DEFERRED, f"{verdict.reason}: all {self.config.slots} "
                                       f"remediation slots are held by other nodes; will retry", WARNING)
                return
            self.deferred_until = None
            if await self.actions.apply("cordon", lambda n: state.cordon_patch(n, self.keys, verdict.reason,
                                                                                verdict.hardware, now)):
                await self.events.emit("Cordoned", f"{verdict.reason}: {verdict.describe()} (slot {slot})", WARNING)
                if verdict.reason != ESCALATION_REASON:  # the failed reset was counted when it was tried
                    await self.remediated(f"cordon for {verdict.reason}")
        elif rec.reason != verdict.reason and await self.actions.apply(
                "cordon", lambda n: state.reason_patch(n, self.keys, verdict.reason, verdict.hardware)):
            await self.events.emit("CordonReasonChanged", f"{rec.reason} -> {verdict.reason}: "
                                   f"{verdict.describe()}", WARNING)
        if self.recorded().healthy_since is not None:
            await self.actions.apply("annotate", lambda n: state.annotate({self.keys.healthy_since: None}))
        if verdict.severity is Severity.DRAIN:
            await self.node_drain.start()

    async def remediated(self, what: str) -> None:
        """Stamp one remediation on the node; the `latchCount`-th within the window latches NeedsHumanAttention."""
        cfg = self.config
        outcome = latch.record(self.actions.node, self.latch_keys, self.clock.now(), count=cfg.latch_count,
                               window=cfg.latch_window_seconds, what=what)
        if not await self.actions.apply("annotate", lambda n: state.annotate(outcome.annotations)):
            return
        if outcome.trips and latch.latched(self.actions.node, self.latch_keys):
            self.counter.count("latch", "ok")
            self.counter.latched(True)
            await self.events.emit(latch.LATCH_REASON, outcome.message, WARNING)

    async def _latch_cleared(self, verdict: NodeVerdict | None) -> None:
        """A person removed the latch annotation (the condition still says NeedsHumanAttention): forget the
        history and, when nothing is wrong now, lift the agent's cordon at once: the person has said it is fixed."""
        condition = self.actions.condition()
        if condition is None or condition.reason != latch.LATCH_REASON or latch.latched(self.actions.node,
                                                                                          self.latch_keys):
            return
        rec = self.recorded()
        await self.actions.apply("annotate", lambda n: state.annotate({self.latch_keys.history: None}))
        self.counter.count("latch", "cleared")
        faulty = verdict is not None and verdict.severity >= Severity.CORDON
        if rec.cordoned and not faulty and await self.actions.apply(
                "uncordon", lambda n: state.uncordon_patch(n, self.keys)):
            await self.slots.release()
        await self._say("NeedsHumanAttentionCleared", condition.message,
                        f"the annotation {self.latch_keys.latched} was removed: latch cleared"
                        + ("" if faulty or not rec.cordoned else "; lifted the agent's cordon"))
        if not faulty:
            await self.actions.ensure_condition(False, "NeedsHumanAttentionCleared",
                                                f"a person removed {self.latch_keys.latched}")

    async def _not_faulty(self, verdict: NodeVerdict) -> None:
        self.deferred_until = None
        rec = self.recorded()
        now = self.clock.now()
        if verdict.severity > Severity.HEALTHY or not (rec.cordoned or rec.override_reason):
            if rec.healthy_since is not None:
                await self.actions.apply("annotate", lambda n: state.annotate({self.keys.healthy_since: None}))
            return
        if rec.healthy_since is None:
            stamp = format_time(now)
            await self.actions.apply("annotate", lambda n: state.annotate({self.keys.healthy_since: stamp}))
            return
        if now < rec.healthy_since + self.config.healthy_window_seconds:
            return
        if not rec.cordoned:  # an admin's uncordon is forgotten once the fault has cleared for the window
            await self.actions.apply("annotate", lambda n: state.annotate(
                {self.keys.override: None, self.keys.healthy_since: None}))
            self._said.discard(("override", rec.override_reason))
            return
        allowed, why = may_uncordon(self.config, rec.reason, rec.hardware)
        if not allowed:
            if ("UncordonHeld", rec.reason) not in self._said:
                self.counter.count("uncordon", "held")
            await self._say("UncordonHeld", rec.reason, f"healthy again, but the cordon for {rec.reason} stays: "
                            f"{why}; uncordon by hand when repaired")
            return
        if await self.actions.apply("uncordon", lambda n: state.uncordon_patch(n, self.keys)):
            await self.events.emit("Uncordoned", f"healthy for {self.config.healthy_window_seconds:.0f}s after "
                                   f"{rec.reason}; lifted the agent's cordon ({why})")
            self._said = {s for s in self._said if s[1] != rec.reason}
        await self.slots.release()

    async def _condition(self, verdict: NodeVerdict | None) -> None:
        pre = self.inputs.preflight
        self._had_verdict = self._had_verdict or verdict is not None
        before = self.actions.condition()
        was_problem = before is not None and before.status == "True"
        latched = self.actions.node.annotations.get(self.latch_keys.latched)
        if latched is not None:
            await self.actions.ensure_condition(True, latch.LATCH_REASON, f"{latched}; remove the annotation "
                                                f"{self.latch_keys.latched} once repaired")
        elif pre.active and pre.failure:
            await self.actions.ensure_condition(True, "PreflightFailed", pre.failure)
        elif verdict is None:
            current = self.actions.condition()
            if pre.passed and current is not None and current.reason == "PreflightFailed":
                await self.actions.ensure_condition(False, "PreflightPassed", "preflight checks passed")
            elif self._had_verdict and current is not None and current.status == "True":
                # every source that had a verdict withdrew it (a maintenance notice ended, with no health
                # subsystem running): a condition left True would start NHC/Karpenter repair clocks
                await self.actions.ensure_condition(False, "Cleared", "no source reports a problem any more")
        elif verdict.severity is Severity.ISOLATE:  # not a node problem: NHC/Karpenter must not act on it
            await self._fault_condition(False, verdict, "device isolated, node schedulable: "
                                        + verdict.describe() + await self._pods(verdict))
        elif verdict.severity >= Severity.DEGRADED:
            deferred = f"{state.DEFERRED} (no free slot): " if self.deferred_until is not None else ""
            message = deferred + verdict.describe() + await self._pods(verdict)
            await self._fault_condition(True, verdict, message)
            repeat = was_problem and before is not None and before.reason == verdict.reason
            if verdict.severity is Severity.DEGRADED and not repeat:
                await self.events.emit("Degraded", f"{verdict.reason}: {verdict.describe()}", WARNING)
        else:
            self._findings = frozenset()  # healthy: the same fault again is a new incident
            await self.actions.ensure_condition(False, verdict.reason, verdict.describe())
            if was_problem:  # the condition on the node, so a restarted agent does not say it twice
                await self.events.emit("Recovered", f"{verdict.reason}: {verdict.describe()}")

    async def _fault_condition(self, problem: bool, verdict: NodeVerdict, message: str) -> None:
        """Set the condition for a fault; findings not seen before become incidents in the same write. A condition
        already saying this (a restarted agent) records nothing: those findings were recorded when it was set."""
        findings = frozenset((verdict.reason, device) for device in verdict.devices or ("",))
        fresh = findings - self._findings
        extra = incidents.recorded(self.actions.node.annotations, self.config.prefix, self.clock.now(), verdict.reason,
                                   findings=len(fresh), window_seconds=self.config.latch_window_seconds) \
            if fresh and self.actions.condition_differs(problem, verdict.reason, message) else None
        await self.actions.ensure_condition(problem, verdict.reason, message, annotations=extra)
        self._findings = findings
        if extra:
            self.counter.incidents(len(fresh))

    async def _pods(self, verdict: NodeVerdict) -> str:
        """' (pods: a/b, c/d)' for the pods holding the verdict's devices now; '' when none or unknown."""
        if not verdict.devices:
            return ""
        pods = await self.isolation.holders(verdict.devices)  # never raises
        return f" (pods: {', '.join(pods)})" if pods else ""

    async def _reset_holders(self, devices: Sequence[str]) -> list[str] | None:
        """The pods holding a GPU before its reset: the kubelet's word now (None: it did not answer, so wait);
        without PodResources at all, nobody can be named and NVML's process list is the only check."""
        return [] if self.isolation.pods_of is None else await self.isolation.holders(devices)

    def _drain_wanted(self) -> bool:
        verdict = self.inputs.effective()
        return verdict is not None and verdict.severity is Severity.DRAIN and self.recorded().cordoned

    def _drained_for_reset(self, verdict: NodeVerdict) -> bool:
        """Whether the drain the verdict asks for is over (finished or past its deadline), so a reset may run."""
        if not self.config.drain:
            return True
        if verdict.severity is Severity.ISOLATE:
            return self.actions.node.annotations.get(self.isolation.keys.drain, "") in OVER
        if verdict.severity is Severity.DRAIN:
            return self.node_drain.over()
        return True

    async def close(self) -> None:
        """Stop a running drain or GPU reset and wait for it."""
        await self.gpu_resets.close()
        await self.isolation.close()
        await self.node_drain.close()
