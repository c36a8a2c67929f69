"""Drain modes per workload: which rule covers a pod, and when (if ever) the drain may evict it.

First matching `remediation.drainModes` rule wins (namespaces and/or an equality label selector; an empty part
matches everything); a pod no rule covers gets `remediation.defaultDrainMode`. Training jobs need this: a long
job should get time to checkpoint (`DeleteAfterTimeout`, counted from the fault so that an agent restart does
not restart the clock) or be left to finish (`AllowCompletion`). A pod may ask for a shorter timeout with the
annotation `<prefix>/drain-timeout-seconds`, never a longer one: the configured value is the operator's promise
about how long a broken node keeps running work.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from agent.config.remediation import DrainRule, RemediationConfig, parse_selector
from agent.kube.model import PodView, format_time

log = logging.getLogger(__name__)

IMMEDIATE = "Immediate"
ALLOW_COMPLETION = "AllowCompletion"
DELETE_AFTER_TIMEOUT = "DeleteAfterTimeout"
TIMEOUT_ANNOTATION = "drain-timeout-seconds"


@dataclass(frozen=True)
class PodPlan:
    """How the drain treats one pod: its mode, the rule that chose it, and when it may be evicted."""

    mode: str
    rule: str  # "drainModes[2]" or "defaultDrainMode"
    evict_at: float | None  # None: never evicted (AllowCompletion)
    note: str = ""  # why the annotation was ignored or applied

    def describe(self, deadline: float) -> str:
        """The pod Event's message."""
        if self.evict_at is None:
            text = (f"drain mode {self.mode} ({self.rule}): not evicted; the node's drain waits for the pod to "
                    f"finish until {format_time(deadline)}")
        else:
            text = f"drain mode {self.mode} ({self.rule}): eviction at {format_time(self.evict_at)}"
        return f"{text}{'; ' + self.note if self.note else ''}"


class DrainPlanner:
    """Matches pods against the configured rules (parsed once)."""

    def __init__(self, config: RemediationConfig) -> None:
        self._rules = [(rule, set(rule.namespaces), parse_selector(rule.pod_selector)) for rule in config.drain_modes]
        self._default = config.default_drain_mode
        self._default_timeout = config.default_drain_timeout_seconds
        self._annotation = f"{config.prefix}/{TIMEOUT_ANNOTATION}"

    def rule_for(self, pod: PodView) -> tuple[DrainRule | None, str]:
        """The first rule covering the pod and its name, or (None, "defaultDrainMode")."""
        labels = dict(pod.labels)
        for i, (rule, namespaces, selector) in enumerate(self._rules):
            if namespaces and pod.namespace not in namespaces:
                continue
            if all(labels.get(key) == value for key, value in selector):
                return rule, f"drainModes[{i}]"
        return None, "defaultDrainMode"

    def plan(self, pod: PodView, fault_at: float) -> PodPlan:
        """When the pod may be evicted, counted from the fault."""
        rule, name = self.rule_for(pod)
        mode = rule.mode if rule is not None else self._default
        if mode == ALLOW_COMPLETION:
            return PodPlan(mode, name, None)
        if mode != DELETE_AFTER_TIMEOUT:
            return PodPlan(mode, name, fault_at)
        limit = rule.timeout_seconds if rule is not None else self._default_timeout
        asked, note = self._asked(pod, limit)
        return PodPlan(mode, name, fault_at + (asked if asked is not None else limit), note)

    def _asked(self, pod: PodView, limit: float) -> tuple[float | None, str]:
        raw = pod.annotation(self._annotation)
        if raw is None:
            return None, ""
        try:
            asked = float(raw.strip())
        except ValueError:
            asked = math.nan
        if not math.isfinite(asked) or asked < 0:
            log.warning("drain: pod %s/%s: annotation %s=%r is not a number of seconds; ignored",
                        pod.namespace, pod.name, self._annotation, raw)
            return None, f"annotation {self._annotation}={raw!r} ignored (not a number of seconds)"
        if asked > limit:
            return None, f"annotation {self._annotation} asked for {asked:.0f}s, more than the configured {limit:.0f}s"
        return asked, f"annotation {self._annotation} asked for {asked:.0f}s"
