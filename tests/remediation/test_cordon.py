"""Cordon, condition, Events and uncordon through the service, against the HTTP double."""

from __future__ import annotations

from collections.abc import Sequence

from agent.signals import NodeVerdict, Severity
from tests.remediation.conftest import AGENT_NS, NODE, Harness, make_config

P = "gpunodeagent.io"
XID79 = NodeVerdict(Severity.CORDON, "GpuXid79", "GPU fell off the bus", ("GPU-1",), hardware=True)
XID13 = NodeVerdict(Severity.CORDON, "GpuXid13", "graphics engine exception", ("GPU-2",))
HEALTHY = NodeVerdict(Severity.HEALTHY, "GpuHealthy", "all checks pass")


def our_taint(harness: Harness) -> dict[str, str] | None:
    return next((t for t in harness.api.taints if t["key"] == f"{P}/gpu-unhealthy"), None)


async def test_nothing_is_published_before_the_first_verdict(harness: Harness):
    await harness.start()
    await harness.advance(900)
    assert harness.writes() == []
    assert [r.method for r in harness.api.requests if not r.watch] == ["GET"]


async def test_healthy_verdict_sets_the_condition_false_once(harness: Harness):
    await harness.start()
    await harness.verdict(HEALTHY)
    await harness.verdict(HEALTHY)
    condition = harness.api.condition("GpuUnhealthy")
    assert condition is not None and condition["status"] == "False" and condition["reason"] == "GpuHealthy"
    assert len(harness.writes()) == 1
    assert harness.api.condition("Ready")["status"] == "True"


async def test_cordon_taints_annotates_sets_condition_and_emits_an_event(harness: Harness):
    await harness.start()
    await harness.verdict(XID79)
    node = harness.api.node
    assert node["spec"]["unschedulable"] is True
    assert our_taint(harness) == {"key": f"{P}/gpu-unhealthy", "value": "GpuXid79", "effect": "NoSchedule"}
    annotations = harness.api.annotations
    assert annotations[f"{P}/cordon-by"] == "gpu-node-agent"
    assert annotations[f"{P}/cordon-reason"] == "GpuXid79"
    assert annotations[f"{P}/cordon-hardware"] == "true"
    assert annotations[f"{P}/cordon-unschedulable"] == "true"
    condition = harness.api.condition("GpuUnhealthy")
    assert (condition["status"], condition["reason"]) == ("True", "GpuXid79")
    assert "GPU-1" in condition["message"]
    assert harness.event_reasons() == ["Cordoned"]
    assert [lease["spec"]["holderIdentity"] for lease in harness.api.leases.values()] == [NODE]
    assert harness.actions("cordon", "ok") == 1 and harness.actions("slot", "acquired") == 1


async def test_degraded_reports_without_cordoning(harness: Harness):
    await harness.start()
    await harness.verdict(NodeVerdict(Severity.DEGRADED, "GpuEccCorrectableHigh", "many correctable errors"))
    assert not harness.api.node["spec"].get("unschedulable")
    assert harness.api.condition("GpuUnhealthy")["status"] == "True"
    assert harness.api.leases == {}
    assert harness.event_reasons() == ["Degraded"]
    await harness.verdict(HEALTHY)
    assert harness.event_reasons() == ["Degraded", "Recovered"]


async def test_uncordon_after_the_healthy_window_for_a_non_hardware_fault(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    assert our_taint(harness) is not None
    await harness.verdict(HEALTHY)
    assert harness.api.condition("GpuUnhealthy")["status"] == "False"
    assert f"{P}/healthy-since" in harness.api.annotations
    await harness.advance(599)
    assert our_taint(harness) is not None
    await harness.advance(2)
    assert our_taint(harness) is None
    assert not harness.api.node["spec"]["unschedulable"]
    assert not any(k.startswith(f"{P}/cordon") for k in harness.api.annotations)
    assert "Uncordoned" in harness.event_reasons()
    lease = harness.api.leases[(AGENT_NS, next(iter(harness.api.leases))[1])]
    assert not lease["spec"].get("holderIdentity")  # slot released


async def test_a_relapse_restarts_the_healthy_window(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    await harness.verdict(HEALTHY)
    await harness.advance(500)
    await harness.verdict(XID13)
    assert f"{P}/healthy-since" not in harness.api.annotations
    await harness.verdict(HEALTHY)
    await harness.advance(500)
    assert our_taint(harness) is not None
    await harness.advance(101)
    assert our_taint(harness) is None


async def test_hardware_faults_stay_cordoned_by_default(harness: Harness):
    await harness.start()
    await harness.verdict(XID79)
    await harness.verdict(HEALTHY)
    await harness.advance(3600)
    assert our_taint(harness) is not None and harness.api.node["spec"]["unschedulable"]
    assert harness.event_reasons().count("UncordonHeld") == 1
    assert harness.actions("uncordon", "held") == 1


async def test_policy_lists_override_the_hardware_default(harness: Harness):
    await harness.start(make_config(uncordon_allow_reasons=["GpuXid79"], uncordon_deny_reasons=["GpuXid13"]))
    await harness.verdict(XID79)
    await harness.verdict(HEALTHY)
    await harness.advance(601)
    assert our_taint(harness) is None
    await harness.verdict(XID13)
    await harness.verdict(HEALTHY)
    await harness.advance(3600)
    assert our_taint(harness) is not None


async def test_a_new_fault_on_a_cordoned_node_updates_the_reason(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    await harness.verdict(XID79)
    assert our_taint(harness)["value"] == "GpuXid79"
    assert harness.api.annotations[f"{P}/cordon-reason"] == "GpuXid79"
    assert harness.api.annotations[f"{P}/cordon-hardware"] == "true"
    assert "CordonReasonChanged" in harness.event_reasons()


async def test_an_admins_cordon_is_never_lifted_by_the_agent(harness: Harness):
    harness.api.admin_patch({"spec": {"unschedulable": True}})
    await harness.start()
    await harness.verdict(XID13)
    assert harness.api.annotations[f"{P}/cordon-unschedulable"] == "false"
    await harness.verdict(HEALTHY)
    await harness.advance(601)
    assert our_taint(harness) is None
    assert harness.api.node["spec"]["unschedulable"] is True  # the admin's cordon stays


async def test_condition_names_the_pods_holding_the_devices(harness: Harness):
    async def pods_of(devices: Sequence[str]) -> list[str] | None:
        return ["ml/trainer-0"] if "GPU-1" in devices else []

    await harness.start(pods_of=pods_of)
    await harness.verdict(XID79)
    condition = harness.api.condition("GpuUnhealthy")
    assert condition["status"] == "True" and "GPU-1" in condition["message"]
    assert condition["message"].endswith("(pods: ml/trainer-0)")
