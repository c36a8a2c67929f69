"""The NodeCondition types the agent owns, recorded on the node, so that one it no longer sets is removed.

NodeHealthCheck and Karpenter act on a condition from its `lastTransitionTime`; a condition of a type the agent
stopped setting (`conditionType` renamed, `rebootConditionType` turned off, an older agent version) would stay as
it was forever, and a stale True makes them act at once on a healthy node (aws/eks-node-monitoring-agent#275).
The annotation `P/condition-types` lists the types this agent may set; at start every type listed before that
the configuration no longer sets is removed. No list means `GpuUnhealthy`, the only type earlier versions set and
the default, so a node with the default configuration never needs the annotation (no write at all).
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.remediation import state
from agent.remediation.actions import NodeActions
from agent.remediation.events import EventRecorder

LEGACY_TYPES = ("GpuUnhealthy",)


def owned_types(condition_type: str, reboot_condition_type: str) -> list[str]:
    """The condition types this configuration sets."""
    return sorted({condition_type, reboot_condition_type} - {""})


async def forget_stale_conditions(actions: NodeActions, events: EventRecorder, key: str,
                                  owned: Sequence[str]) -> list[str]:
    """Remove the conditions of types recorded (or legacy) but no longer owned, then record `owned`; the removed
    types. Raises ApiError (the caller retries)."""
    text = actions.node.annotations.get(key)
    before = {t for t in text.split(",") if t} if text is not None else set(LEGACY_TYPES)
    removed = [t for t in sorted(before - set(owned)) if await actions.remove_condition(t)]
    for kind in removed:
        await events.emit("StaleConditionRemoved", f"removed condition {kind}: this agent's configuration no "
                          f"longer sets it, and a stale value would mislead NodeHealthCheck or Karpenter")
    wanted = ",".join(sorted(owned))
    if text != wanted and not (text is None and sorted(owned) == sorted(LEGACY_TYPES)):  # no list = the legacy one
        await actions.apply("annotate", lambda n: state.annotate({key: wanted}))
    return removed
