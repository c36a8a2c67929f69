"""Small pieces: verdict values, Event folding and rate limit, slot contention, config checks, the simulation."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
from prometheus_client import CollectorRegistry

from agent import config
from agent.config.remediation import RemediationConfig
from agent.kube.errors import ApiNotFound
from agent.kube.model import EventRecord, LeaseView, NodeView
from agent.kube.simulated import InMemoryCluster
from agent.remediation import RemediationService, simulated_cluster
from agent.remediation.events import EventRecorder
from agent.remediation.metrics import ActionCounter
from agent.remediation.slots import Slots
from agent.signals import Latest, NodeVerdict, Severity, worst
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until


def test_verdicts_validate_and_order():
    with pytest.raises(ValueError, match="CamelCase"):
        NodeVerdict(Severity.CORDON, "gpu xid 79")
    with pytest.raises(ValueError, match="verdict"):
        NodeVerdict("reboot", "GpuXid79")  # type: ignore[arg-type]
    cordon = NodeVerdict(Severity.CORDON, "GpuXid79", "m", ("GPU-0", "GPU-1"), True)
    assert cordon.describe() == "m (devices: GPU-0, GPU-1)"
    assert worst(None, NodeVerdict(Severity.DEGRADED, "A"), cordon) is cordon
    assert worst(None, None) is None


def test_the_verdict_contract_rejects_what_remediation_could_not_act_on():
    assert NodeVerdict(Severity.DRAIN, "GpuXid79", "Xid 79 on GPU-1", ("GPU-1",), True).describe() == \
        "Xid 79 on GPU-1 (devices: GPU-1)"
    with pytest.raises(ValueError, match="CamelCase"):  # it becomes a taint value and an Event reason
        NodeVerdict(Severity.CORDON, "xid 79")
    with pytest.raises(ValueError, match="not one of"):
        NodeVerdict("reboot", "GpuXid79")  # type: ignore[arg-type]


class RecordingEvents:
    def __init__(self) -> None:
        self.written: list[EventRecord] = []
        self.expire = False

    async def write_event(self, event: EventRecord) -> EventRecord:
        if event.name and self.expire:
            raise ApiNotFound(404, "gone")
        event = dataclasses.replace(event, name=event.name or f"e{len(self.written)}")
        self.written.append(event)
        return event


async def test_identical_events_are_folded_then_patched_with_the_count():
    api, clock = RecordingEvents(), FakeClock()
    recorder = EventRecorder(api, clock)
    for _ in range(5):
        await recorder.emit("RemediationDeferred", "no slot")
        await clock.advance(60)
    assert len(api.written) == 1
    await clock.advance(600)
    await recorder.emit("RemediationDeferred", "no slot")
    assert [(e.name, e.count) for e in api.written] == [("e0", 1), ("e0", 6)]
    api.expire = True  # the API server's event TTL removed it
    await clock.advance(601)
    await recorder.emit("RemediationDeferred", "no slot")
    assert api.written[-1].count == 1 and api.written[-1].name == "e2"


async def test_a_flapping_fault_is_rate_limited():
    api, clock = RecordingEvents(), FakeClock()
    recorder = EventRecorder(api, clock, burst=3, refill_seconds=300)
    for index in range(10):
        await recorder.emit("Cordoned", f"fault {index}")
    assert len(api.written) == 3 and recorder.dropped == 7
    await clock.advance(300)
    await recorder.emit("Cordoned", "fault 11")
    assert len(api.written) == 4


async def test_two_nodes_racing_for_the_last_slot_do_not_both_win():
    cluster, clock = InMemoryCluster("a"), FakeClock()
    registry = CollectorRegistry()
    counter = ActionCounter(registry)

    def slots(holder: str) -> Slots:
        return Slots(cluster, clock, counter, namespace="ns", count=1, holder=holder, lease_seconds=60,
                     label="x/slot")
    first, second = slots("node-a"), slots("node-b")
    results = await asyncio.gather(first.acquire(), second.acquire())
    assert sorted(r is not None for r in results) == [False, True]
    assert registry.get_sample_value("gpu_node_agent_remediation_actions_total",
                                     {"action": "slot", "result": "none_free"}) == 1
    winner = first if first.held else second
    await winner.release()
    loser = second if winner is first else first
    assert await loser.acquire() == "gpu-remediation-slot-0"


def test_expired_leases():
    lease = LeaseView("s", "n", 60.0, 1000.0)
    assert not lease.expired(1059.0) and lease.expired(1060.0)
    assert LeaseView("s", "", 60.0, 1000.0).expired(0.0)


def test_remediation_settings_from_flags_and_environment():
    import argparse
    parser = argparse.ArgumentParser()
    config.add_flags(parser)
    args = parser.parse_args(["--remediation", "--dry-run", "--kubeconfig", "/etc/kc", "--remediation-slots", "5",
                              "--uncordon-allow-reason", "GpuXid79", "--uncordon-allow-reason", "GpuXid48",
                              "--maintenance-cloud", "azure"])
    loaded = config.load(args, {"GPU_NODE_AGENT_HEALTHY_WINDOW": "900", "NODE_NAME": "n1",
                                "GPU_NODE_AGENT_PREFLIGHT_COMMAND": "/usr/bin/check,--quick"})
    cfg = loaded.remediation
    assert (cfg.enabled, cfg.dry_run, loaded.api_server.kubeconfig, cfg.slots) == (True, True, "/etc/kc", 5)
    assert cfg.uncordon_allow_reasons == ["GpuXid79", "GpuXid48"] and cfg.maintenance_clouds == ["azure"]
    assert cfg.healthy_window_seconds == 900.0 and cfg.preflight_command == ["/usr/bin/check", "--quick"]


@pytest.mark.parametrize(("settings", "named"), [
    ({"slots": 0}, "slots"),
    ({"conditionHeartbeatSeconds": 60}, "conditionHeartbeatSeconds"),
    ({"maintenanceClouds": ["oracle"]}, "oracle"),
    ({"uncordonPolicy": "sometimes"}, "sometimes"),
])
def test_unsafe_remediation_settings_are_rejected(settings, named):
    from agent.config.load import from_mapping
    from agent.config.model import AgentConfig
    with pytest.raises(config.ConfigError, match=named):
        from_mapping(AgentConfig, {"remediation": settings})


def test_lease_namespace_falls_back_to_the_agents_namespace():
    assert RemediationConfig(pod_namespace="gpu-system").lease_namespace() == "gpu-system"
    assert RemediationConfig(pod_namespace="a", slot_namespace="b").lease_namespace() == "b"
    assert RemediationConfig().lease_namespace() == "default"


async def test_simulated_dry_run_shows_the_decisions_without_a_cluster(caplog):
    caplog.set_level(logging.INFO)
    cluster = simulated_cluster("sim-node")
    queue: Latest[NodeVerdict] = Latest()
    cfg = RemediationConfig(enabled=True, dry_run=True, preflight_taint="")
    registry = CollectorRegistry()
    service = RemediationService(cfg, "sim-node", cluster, queue, registry)
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    queue.set(NodeVerdict(Severity.DRAIN, "GpuXid79", "GPU has fallen off the bus", ("GPU-3",), hardware=True))
    await until(lambda: any(e.reason == "Cordoned" for e in cluster.events), "the cordon Event")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert [e.reason for e in cluster.events][:2] == ["Cordoned", "Draining"]
    assert "default/training-job-0" in cluster.events[1].message and "nvidia" not in cluster.events[1].message
    assert len(cluster.pods) == 2  # nothing evicted
    assert cluster.node == dataclasses.replace(NodeView("sim-node"), resource_version=cluster.node.resource_version)
    assert cluster.leases == {}
    assert "[dry-run] GpuXid79" in caplog.text and "would cordon" in caplog.text  # the operator-facing line
    dry_run = {"action": "cordon", "result": "dry_run"}  # the decision itself, on /metrics
    assert registry.get_sample_value("gpu_node_agent_remediation_actions_total", dry_run) == 1
    assert registry.get_sample_value("gpu_node_agent_remediation_actions_total", {**dry_run, "result": "ok"}) is None


async def test_the_simulation_also_applies_changes_without_dry_run():
    cluster = simulated_cluster("sim-node")
    queue: Latest[NodeVerdict] = Latest()
    service = RemediationService(RemediationConfig(enabled=True, preflight_taint=""), "sim-node", cluster, queue,
                                 CollectorRegistry())
    stop = asyncio.Event()
    task = asyncio.create_task(service.run(stop))
    queue.set(NodeVerdict(Severity.CORDON, "GpuXid79", "fell off", hardware=True))
    await until(lambda: cluster.node.unschedulable, "the cordon")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert cluster.node.unschedulable and cluster.node.taint("gpunodeagent.io/gpu-unhealthy") is not None
    assert cluster.node.conditions["GpuUnhealthy"].status == "True"
