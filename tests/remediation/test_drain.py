"""Drain through the Eviction API: what is skipped, 429 backoff, 500 reporting, deadline, and stopping."""

from __future__ import annotations

from agent.signals import NodeVerdict, Severity
from tests.remediation.conftest import AGENT_NS, AGENT_POD, Harness, make_config
from tests.remediation.test_cordon import HEALTHY

P = "gpunodeagent.io"
DRAIN = NodeVerdict(Severity.DRAIN, "GpuXid79", "GPU fell off the bus", ("GPU-1",), hardware=True)


def evictions(harness: Harness) -> list[str]:
    return [r.path.split("/")[6] for r in harness.api.requests if r.path.endswith("/eviction")]


async def test_drain_evicts_workloads_and_skips_daemonsets_mirrors_finished_and_itself(harness: Harness):
    api = harness.api
    api.add_pod("team", "train-0")
    api.add_pod("team", "bare", owner="")
    api.add_pod("kube-system", "nvidia-dp", owner="DaemonSet")
    api.add_pod("kube-system", "static-etcd", mirror=True, owner="Node")
    api.add_pod("team", "done", phase="Succeeded")
    api.add_pod(AGENT_NS, AGENT_POD, owner="DaemonSet")
    api.add_pod(AGENT_NS, "not-the-agent-but-same-ns")
    await harness.start()
    await harness.verdict(DRAIN)
    assert sorted(evictions(harness)) == ["bare", "not-the-agent-but-same-ns", "train-0"]
    assert api.node["spec"]["unschedulable"] is True
    await harness.advance(11)  # the next pass sees nothing left
    assert api.annotations[f"{P}/drain"] == "complete"
    assert {"Cordoned", "Draining", "DrainComplete"} <= set(harness.event_reasons())
    assert harness.actions("evict", "ok") == 3 and harness.actions("drain", "complete") == 1


async def test_429_backs_off_and_retries(harness: Harness):
    harness.api.add_pod("team", "guarded")
    harness.api.evictions[("team", "guarded")] = [429, 429]
    await harness.start()
    await harness.verdict(DRAIN)
    assert evictions(harness) == ["guarded"]
    await harness.advance(9)  # no hot loop: the next round waits max(backoff, Retry-After 7 s, 10 s poll)
    assert evictions(harness) == ["guarded"]
    await harness.advance(2)
    assert evictions(harness) == ["guarded", "guarded"]
    await harness.advance(30)
    assert evictions(harness) == ["guarded"] * 3
    assert ("team", "guarded") not in harness.api.pods
    assert harness.actions("evict", "throttled") == 2 and harness.actions("evict", "ok") == 1


async def test_500_is_reported_and_retried_slowly(harness: Harness):
    harness.api.add_pod("team", "two-pdbs")
    harness.api.evictions[("team", "two-pdbs")] = [500, 500]
    await harness.start()
    await harness.verdict(DRAIN)
    assert "EvictionBlocked" in harness.event_reasons()
    blocked = next(e for e in harness.api.events.values() if e["reason"] == "EvictionBlocked")
    assert blocked["type"] == "Warning" and "PodDisruptionBudget" in blocked["message"]
    await harness.advance(250)
    assert evictions(harness) == ["two-pdbs"]  # slow pace: eviction_blocked_retry_seconds (300)
    await harness.advance(100)
    assert evictions(harness) == ["two-pdbs"] * 2
    await harness.advance(300)
    assert ("team", "two-pdbs") not in harness.api.pods


async def test_the_deadline_stops_the_drain_and_reports(harness: Harness):
    harness.api.add_pod("team", "stuck")
    harness.api.evictions[("team", "stuck")] = [429] * 1000
    await harness.start(make_config(drain_deadline_seconds=120))
    await harness.verdict(DRAIN)
    await harness.advance(200)
    assert harness.api.annotations[f"{P}/drain"] == "deadline"
    event = next(e for e in harness.api.events.values() if e["reason"] == "DrainDeadlineExceeded")
    assert "team/stuck" in event["message"] and event["type"] == "Warning"
    tries = len(evictions(harness))
    await harness.advance(600)
    assert len(evictions(harness)) == tries  # stopped for good


async def test_the_drain_stops_when_the_fault_no_longer_asks_for_it(harness: Harness):
    harness.api.add_pod("team", "guarded")
    harness.api.evictions[("team", "guarded")] = [429] * 1000
    await harness.start()
    await harness.verdict(DRAIN)
    await harness.verdict(HEALTHY)
    tries = len(evictions(harness))
    await harness.advance(300)
    assert len(evictions(harness)) == tries
    assert ("team", "guarded") in harness.api.pods


async def test_drain_off_only_cordons(harness: Harness):
    harness.api.add_pod("team", "train-0")
    await harness.start(make_config(drain=False))
    await harness.verdict(DRAIN)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert evictions(harness) == []


async def test_a_restarted_agent_keeps_the_original_drain_deadline(harness: Harness):
    harness.api.add_pod("team", "stuck")
    harness.api.evictions[("team", "stuck")] = [429] * 1000
    await harness.start(make_config(drain_deadline_seconds=300))
    await harness.verdict(DRAIN)
    await harness.advance(200)
    await harness.restart(make_config(drain_deadline_seconds=300))
    await harness.verdict(DRAIN)
    await harness.advance(120)
    assert harness.api.annotations[f"{P}/drain"] == "deadline"
