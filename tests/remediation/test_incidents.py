"""Incidents on the Node against the HTTP API double with the fake clock: each new finding is recorded in the
condition's own nodes/status write; a restarted agent does not count a finding the condition already says; the same
fault after health is a new incident; an annotation that is not the agent's JSON is started afresh."""

from __future__ import annotations

import json

from agent.remediation import incidents
from agent.signals import NodeVerdict, Severity
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_cordon import HEALTHY, P

KEY = f"{P}/incidents"
ONE = NodeVerdict(Severity.DEGRADED, "GpuXid31", "memory page fault", ("GPU-1",))
TWO = NodeVerdict(Severity.DEGRADED, "GpuXid31", "memory page fault", ("GPU-1", "GPU-2"))


def recorded(harness: Harness) -> dict:
    return json.loads(harness.api.annotations[KEY])


def incidents_total(harness: Harness) -> float | None:
    return harness.registry.get_sample_value("gpu_node_agent_incidents_total")


async def test_findings_are_counted_once_across_a_restart_and_again_after_health(harness: Harness):
    config = make_config()
    await harness.start(config)
    await harness.verdict(ONE)
    assert recorded(harness)["count"] == 1 and incidents_total(harness) == 1
    mark = harness.mark()
    await harness.verdict(TWO)
    assert recorded(harness)["count"] == 2 and incidents_total(harness) == 2
    writes = harness.writes(mark)
    assert len(writes) == 1 and writes[0].path.endswith("/status")  # the condition's own write, nothing else
    assert KEY in writes[0].body["metadata"]["annotations"]

    await harness.restart(config)
    await harness.verdict(TWO)  # the condition already says this: nothing new
    await harness.advance(400)  # a heartbeat write carries no incident
    assert recorded(harness)["count"] == 2

    await harness.verdict(HEALTHY)
    await harness.verdict(ONE)  # the same fault after health: a new incident
    assert recorded(harness)["count"] == 3 and recorded(harness)["lastCause"] == "GpuXid31"
    assert len(recorded(harness)["recent"]) == 3


async def test_an_annotation_that_is_not_the_agents_json_is_started_afresh(harness: Harness):
    await harness.start(make_config())
    harness.api.admin_patch({"metadata": {"annotations": {KEY: '{"count": "lots"}'}}})
    await harness.settle()
    await harness.verdict(ONE)
    assert recorded(harness)["count"] == 1


def test_parse_refuses_what_is_not_the_json_and_counts_the_window():
    good = incidents.Incidents().record(1000.0, "GpuXid79").record(2000.0, "GpuXid79").record(9000.0, "GpuXid48",
                                                                                               window_seconds=7500)
    back = incidents.parse(good.to_json())
    assert back is not None and back.count == 3 and back.last_cause == "GpuXid48"
    assert back.recent == (2000.0, 9000.0)  # 1000 fell out of the 7,500 s window
    assert back.repeat_offender(9000.0, 2) and not back.repeat_offender(9000.0 + 7500 - 999, 2)
    for text in ("", "x", "[]", '{"count": -1, "windowSeconds": 1, "recent": []}',
                 '{"count": 1, "windowSeconds": 0, "recent": []}', '{"count": true, "windowSeconds": 1, "recent": []}',
                 '{"count": 1, "windowSeconds": 1, "recent": ["yesterday"]}', "[" * 100_000,
                 json.dumps({"count": 1, "windowSeconds": 1, "recent": ["2026-01-01T00:00:00Z"] * 40})):
        assert incidents.parse(text) is None, text
