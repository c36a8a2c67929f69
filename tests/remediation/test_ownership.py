"""Ownership: admin uncordons are final for a fault, slots cap cordons, a restart continues without repeating."""

from __future__ import annotations

from agent.signals import NodeVerdict, Severity
from tests.remediation.conftest import AGENT_NS, NODE, Harness, make_config
from tests.remediation.test_cordon import HEALTHY, XID13, XID79, our_taint

P = "gpunodeagent.io"
LABEL = {f"{P}/remediation-slot": "true"}


def other_nodes_hold(harness: Harness, *slots: int, renewed: float | None = None, duration: int = 3600) -> None:
    from agent.kube.model import format_micro_time
    for index in slots:
        name = f"gpu-remediation-slot-{index}"
        harness.api.leases[(AGENT_NS, name)] = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": AGENT_NS, "labels": LABEL, "resourceVersion": "5"},
            "spec": {"holderIdentity": f"other-{index}", "leaseDurationSeconds": duration,
                     "renewTime": format_micro_time(renewed if renewed is not None else harness.clock.now()),
                     "leaseTransitions": 0}}


async def test_admin_uncordon_is_respected_for_the_same_fault(harness: Harness):
    await harness.start()
    await harness.verdict(XID79)
    harness.api.admin_patch({"spec": {"unschedulable": False}})  # kubectl uncordon
    await harness.settle()
    assert our_taint(harness) is None  # their intent finished: our taint would still keep pods off
    assert harness.api.annotations[f"{P}/admin-uncordoned"] == "GpuXid79"
    assert f"{P}/cordon-by" not in harness.api.annotations
    assert "AdminUncordonRespected" in harness.event_reasons()
    before = len(harness.writes())
    await harness.verdict(HEALTHY)
    await harness.verdict(XID79)  # the same fault, still recorded: not re-cordoned
    await harness.advance(1200)
    assert not harness.api.node["spec"]["unschedulable"] and our_taint(harness) is None
    assert all(r.path.endswith("/status") or "events" in r.path or f"{P}/healthy-since" in str(r.body)
               for r in harness.writes()[before:])
    lease = next(iter(harness.api.leases.values()))
    assert not lease["spec"].get("holderIdentity")  # the slot went back


async def test_removing_our_taint_also_counts_as_an_admin_uncordon(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    harness.api.admin_patch({"spec": {"taints": []}})
    await harness.settle()
    assert harness.api.annotations[f"{P}/admin-uncordoned"] == "GpuXid13"


async def test_a_different_fault_after_an_admin_uncordon_cordons_again(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    harness.api.admin_patch({"spec": {"unschedulable": False}})
    await harness.settle()
    await harness.verdict(XID79)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert our_taint(harness)["value"] == "GpuXid79"
    assert f"{P}/admin-uncordoned" not in harness.api.annotations


async def test_the_admin_override_is_forgotten_after_a_healthy_window(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    harness.api.admin_patch({"spec": {"unschedulable": False}})
    await harness.settle()
    await harness.verdict(HEALTHY)
    await harness.advance(601)
    assert f"{P}/admin-uncordoned" not in harness.api.annotations
    await harness.verdict(XID13)  # the fault is back after a clean window: a new fault
    assert harness.api.node["spec"]["unschedulable"] is True


async def test_no_free_slot_defers_with_condition_and_event_then_retries(harness: Harness):
    other_nodes_hold(harness, 0, 1)
    await harness.start()
    await harness.verdict(XID13)
    assert not harness.api.node["spec"].get("unschedulable")
    assert harness.event_reasons() == ["RemediationDeferred"]
    condition = harness.api.condition("GpuUnhealthy")
    assert condition["status"] == "True" and condition["message"].startswith("RemediationDeferred")
    assert harness.actions("cordon", "deferred") == 1
    lists = len([r for r in harness.api.requests if r.path.endswith("/leases") and r.method == "GET"])
    await harness.advance(100)  # no retry before slotRetrySeconds (300 s, jittered 0.8-1.2)
    assert len([r for r in harness.api.requests if r.path.endswith("/leases") and r.method == "GET"]) == lists
    harness.api.leases[(AGENT_NS, "gpu-remediation-slot-1")]["spec"]["holderIdentity"] = None
    await harness.advance(300)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.api.leases[(AGENT_NS, "gpu-remediation-slot-1")]["spec"]["holderIdentity"] == NODE
    assert harness.api.condition("GpuUnhealthy")["message"] == XID13.describe()  # no longer deferred


async def test_an_expired_slot_is_taken_over(harness: Harness):
    other_nodes_hold(harness, 0, 1, renewed=harness.clock.now() - 7200)
    await harness.start()
    await harness.verdict(XID13)
    assert harness.api.node["spec"]["unschedulable"] is True
    holders = {k[1]: v["spec"]["holderIdentity"] for k, v in harness.api.leases.items()}
    assert NODE in holders.values()
    taken = next(v for v in harness.api.leases.values() if v["spec"]["holderIdentity"] == NODE)
    assert taken["spec"]["leaseTransitions"] == 1


async def test_a_held_slot_is_renewed_while_cordoned(harness: Harness):
    await harness.start(make_config(slot_lease_seconds=600))
    await harness.verdict(XID79)
    lease = next(iter(harness.api.leases.values()))
    first = lease["spec"]["renewTime"]
    await harness.advance(201)
    lease = next(iter(harness.api.leases.values()))
    assert lease["spec"]["renewTime"] != first and lease["spec"]["holderIdentity"] == NODE


async def test_a_restarted_agent_continues_without_repeating(harness: Harness):
    await harness.start()
    await harness.verdict(XID13)
    await harness.verdict(HEALTHY)
    await harness.advance(400)
    events, leases = dict(harness.api.events), harness.api.leases.copy()
    await harness.restart()
    mark = harness.mark()
    await harness.verdict(HEALTHY)
    # no second cordon, no new slot, no new Event: only the (unchanged) condition is left alone
    assert [r for r in harness.writes(mark) if not r.path.endswith("/status")] == []
    assert harness.api.events == events and harness.api.leases.keys() == leases.keys()
    await harness.advance(201)  # the healthy window started before the restart: 400 + 201 > 600
    assert our_taint(harness) is None
    lease = next(iter(harness.api.leases.values()))
    assert not lease["spec"].get("holderIdentity")  # the restarted agent found and released its slot


async def test_a_restarted_agent_resumes_a_cordon_for_the_same_fault(harness: Harness):
    await harness.start()
    await harness.verdict(XID79)
    await harness.restart()
    mark = harness.mark()
    await harness.verdict(XID79)
    assert harness.writes(mark) == []
    assert harness.api.node["spec"]["unschedulable"] is True


async def test_dry_run_decides_and_emits_events_but_changes_nothing_else(harness: Harness):
    await harness.start(make_config(dry_run=True))
    await harness.verdict(NodeVerdict(Severity.DRAIN, "GpuXid79", "fell off", hardware=True))
    harness.api.add_pod("team", "train-0")
    await harness.verdict(NodeVerdict(Severity.DRAIN, "GpuXid79", "fell off again", hardware=True))
    writes = harness.writes()
    assert writes and all("/events" in r.path for r in writes)
    assert harness.api.leases == {} and not harness.api.node["spec"].get("unschedulable")
    messages = [e["message"] for e in harness.api.events.values()]
    assert all(m.startswith("[dry-run]") for m in messages)
    assert "Cordoned" in harness.event_reasons()
    assert harness.actions("cordon", "dry_run") == 1 and harness.actions("condition", "dry_run") >= 1
    await harness.verdict(HEALTHY)
    await harness.advance(3600)
    assert all("/events" in r.path for r in harness.writes())
