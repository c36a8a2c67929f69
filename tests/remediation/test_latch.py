"""The needs-a-human latch against the HTTP API double with the fake clock: the third remediation within the
window latches NeedsHumanAttention, no automatic uncordon, it survives an agent restart, and removing the
annotation clears it."""

from __future__ import annotations

import pytest

from agent.config.load import ConfigError, from_mapping
from agent.config.remediation import RemediationConfig
from agent.signals import NodeVerdict, Severity
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_cordon import HEALTHY, P

XID13 = NodeVerdict(Severity.CORDON, "GpuXid13", "graphics engine exception", ("GPU-2",))
LATCH = f"{P}/needs-human-attention"


def latched_gauge(harness: Harness) -> float | None:
    return harness.registry.get_sample_value("gpu_node_agent_remediation_latched")


async def bounce(harness: Harness) -> None:
    """One remediation: cordon for a non-hardware fault, healthy again, the agent lifts its cordon."""
    await harness.verdict(XID13)
    assert harness.api.node["spec"]["unschedulable"] is True
    await harness.verdict(HEALTHY)
    await harness.advance(601)  # the healthy window (600 s)


async def test_third_remediation_within_the_window_latches_and_survives_a_restart(harness: Harness):
    config = make_config()
    await harness.start(config)
    for _ in range(2):
        await bounce(harness)
        assert not harness.api.node["spec"].get("unschedulable")
    assert LATCH not in harness.api.annotations and latched_gauge(harness) == 0
    await harness.verdict(XID13)
    assert harness.api.annotations[LATCH].startswith("3 remediations since")
    condition = harness.api.condition("GpuUnhealthy")
    assert (condition["status"], condition["reason"]) == ("True", "NeedsHumanAttention")
    assert "NeedsHumanAttention" in harness.event_reasons()
    assert harness.actions("latch", "ok") == 1 and latched_gauge(harness) == 1

    await harness.verdict(HEALTHY)
    await harness.advance(7200)  # no automatic uncordon while latched
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.api.condition("GpuUnhealthy")["reason"] == "NeedsHumanAttention"

    await harness.restart(config)
    await harness.verdict(HEALTHY)
    await harness.advance(7200)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.api.condition("GpuUnhealthy")["reason"] == "NeedsHumanAttention"
    assert latched_gauge(harness) == 1

    harness.api.admin_patch({"metadata": {"annotations": {LATCH: None}}})  # the documented way to clear it
    await harness.settle()
    await harness.advance(1)
    assert not harness.api.node["spec"].get("unschedulable")
    assert not any(t["key"] == f"{P}/gpu-unhealthy" for t in harness.api.taints)
    assert f"{P}/remediation-history" not in harness.api.annotations
    assert harness.api.condition("GpuUnhealthy")["status"] == "False"
    assert harness.actions("latch", "cleared") == 1 and latched_gauge(harness) == 0

    await bounce(harness)  # the history starts afresh: one remediation does not latch again
    assert LATCH not in harness.api.annotations


async def test_remediations_older_than_the_window_do_not_count(harness: Harness):
    await harness.start(make_config(latch_window_seconds=3600))
    await bounce(harness)
    await bounce(harness)
    await harness.advance(3600)
    await bounce(harness)
    assert LATCH not in harness.api.annotations
    assert len(harness.api.annotations[f"{P}/remediation-history"].split(",")) == 1


async def test_latch_off(harness: Harness):
    await harness.start(make_config(latch_count=0))
    for _ in range(4):
        await bounce(harness)
    assert LATCH not in harness.api.annotations and harness.actions("latch", "ok") == 0


async def test_clearing_while_the_fault_persists_keeps_the_cordon(harness: Harness):
    await harness.start(make_config(latch_count=1))
    await harness.verdict(XID13)
    assert LATCH in harness.api.annotations
    harness.api.admin_patch({"metadata": {"annotations": {LATCH: None}}})
    await harness.settle()
    await harness.advance(1)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.api.condition("GpuUnhealthy")["reason"] == "GpuXid13"


def test_latch_settings():
    config = from_mapping(RemediationConfig, {"latchCount": 5, "latchWindowSeconds": 86400})
    assert (config.latch_count, config.latch_window_seconds) == (5, 86400)
    assert (RemediationConfig().latch_count, RemediationConfig().latch_window_seconds) == (3, 604800)
    with pytest.raises(ConfigError, match="latchCount"):
        from_mapping(RemediationConfig, {"latchCount": -1})
