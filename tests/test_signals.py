"""The health contract (`agent.signals`): one ordered Severity, one NodeVerdict, the latest-value cell and the
one owner of device health."""

from __future__ import annotations

import asyncio

import pytest

from agent.config.health import VERDICTS, XID_ACTIONS
from agent.health.checks import Checks, CheckState
from agent.signals import HEALTHY, DeviceHealth, DeviceHealthEvent, Latest, NodeVerdict, Severity


def test_severity_is_ordered_and_never_a_bare_number() -> None:
    assert Severity.HEALTHY < Severity.DEGRADED < Severity.CORDON < Severity.DRAIN
    assert max(Severity) is Severity.DRAIN and sorted(reversed(list(Severity))) == list(Severity)
    with pytest.raises(TypeError):
        assert Severity.CORDON >= 2  # type: ignore[operator]
    assert Severity.CORDON != 2  # type: ignore[comparison-overlap]


def test_one_vocabulary_for_config_metrics_and_xid_overrides() -> None:
    assert VERDICTS == tuple(s.value for s in Severity) == ("healthy", "degraded", "isolate", "cordon", "drain")
    assert XID_ACTIONS == ("none", "degraded", "isolate", "cordon", "drain")
    assert [Severity.parse(word) for word in XID_ACTIONS] == list(Severity)
    assert Severity.parse(" Drain ") is Severity.DRAIN
    with pytest.raises(ValueError, match="expected one of none, degraded, isolate, cordon, drain"):
        Severity.parse("reboot")


def test_the_node_verdict_names_its_severity_by_word() -> None:
    verdict = NodeVerdict(Severity.CORDON, "NicLinkDown", "link down", ("0000:18:00.0",))
    assert verdict.verdict == "cordon" and HEALTHY.verdict == "healthy"
    assert verdict.describe() == "link down (devices: 0000:18:00.0)"


async def test_latest_keeps_only_the_newest_value_and_wakes_waiters() -> None:
    cell: Latest[NodeVerdict] = Latest()
    assert cell.get() is None and cell.version == 0
    waiter = asyncio.create_task(cell.wait_newer(0))
    await asyncio.sleep(0)
    assert not waiter.done()
    assert cell.set(HEALTHY)
    assert await asyncio.wait_for(waiter, 5) == (1, HEALTHY)
    assert not cell.set(NodeVerdict(Severity.HEALTHY, "GpuHealthy", "all GPU and NIC checks pass"))  # equal
    drain = NodeVerdict(Severity.DRAIN, "GpuXid79")
    cell.set(NodeVerdict(Severity.CORDON, "GpuXid13"))
    cell.set(drain)
    assert await cell.wait_newer(1) == (3, drain)  # a slow reader sees the newest, never a backlog


async def test_device_health_has_one_owner_and_reports_flips_only() -> None:
    health = DeviceHealth()
    assert health.replace({"GPU-a": "Xid 79", "0000:18:00.2": "link down"}) == [
        DeviceHealthEvent("0000:18:00.2", False, "link down"), DeviceHealthEvent("GPU-a", False, "Xid 79")]
    assert health.replace({"GPU-a": "Xid 79; ECC", "0000:18:00.2": "link down"}) == []  # a new reason: no flip
    assert health.reason("GPU-a") == "Xid 79; ECC" and not health.is_healthy("GPU-a")
    assert health.replace({"GPU-a": "Xid 79; ECC"}) == [DeviceHealthEvent("0000:18:00.2", True)]
    assert not health.apply(DeviceHealthEvent("GPU-a", False, "again"))
    assert health.apply(DeviceHealthEvent("GPU-a", True))
    assert health.version == 4 and health.unhealthy() == {}
    assert [e.healthy for e in health.since(2) or []] == [True, True]
    waiter = asyncio.create_task(health.wait_newer(4))
    await asyncio.sleep(0)
    assert not waiter.done()
    health.apply(DeviceHealthEvent("GPU-b", False, "lost"))
    assert await asyncio.wait_for(waiter, 5) == 5


def test_device_health_history_says_when_a_reader_fell_behind() -> None:
    health = DeviceHealth()
    for n in range(DeviceHealth.HISTORY + 1):
        health.apply(DeviceHealthEvent("GPU-a", n % 2 == 1, "x"))
    assert health.since(0) is None
    assert health.since(health.version - 1) == [DeviceHealthEvent("GPU-a", False, "x")]


def test_check_states_carry_their_reason() -> None:
    checks = Checks()
    checks.start("kmsg")
    checks.set("nvml_poll", CheckState.UNAVAILABLE, "NVMLError_LibraryNotFound")
    checks.start("nvml_poll")  # already reported: stays
    checks.set("links", CheckState.OK)
    assert checks.text() == {"kmsg": "starting", "links": "ok", "nvml_poll": "unavailable: NVMLError_LibraryNotFound"}
    assert [name for name, status in checks.items() if status.up] == ["links"]
