"""Preflight: the startup taint goes only when the checks pass; failures keep it and set the condition."""

from __future__ import annotations

import sys

from agent.remediation.preflight import CheckResult, build_checks, command_check, run_checks
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_cordon import HEALTHY

KEY = "gpunodeagent.io/preflight"


def tainted(harness: Harness) -> bool:
    return any(t["key"] == KEY for t in harness.api.taints)


def fixed(name: str, ok: bool, detail: str = ""):
    async def check() -> CheckResult:
        return CheckResult(name, ok, detail)
    return check


async def test_passing_checks_remove_the_taint(harness: Harness):
    harness.api.admin_patch({"spec": {"taints": [{"key": KEY, "effect": "NoSchedule"},
                                                 {"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}})
    checks = build_checks(expected_gpus=8, gpu_count=lambda: 8, extra=[fixed("RowRemap", True)])
    await harness.start(make_config(preflight_taint=KEY), checks=tuple(checks))
    await harness.until(lambda: not tainted(harness), "preflight taint removed")
    assert [t["key"] for t in harness.api.taints] == ["nvidia.com/gpu"]  # others' taints stay
    assert "PreflightPassed" in harness.event_reasons()
    assert harness.api.condition("GpuUnhealthy") is None  # nothing to say until the first verdict


async def test_failing_checks_keep_the_taint_set_the_condition_and_retry(harness: Harness):
    harness.api.admin_patch({"spec": {"taints": [{"key": KEY, "effect": "NoSchedule"}]}})
    results = iter([False, True])
    gpus = build_checks(expected_gpus=8, gpu_count=lambda: 8 if next(results) else 7)
    await harness.start(make_config(preflight_taint=KEY, preflight_retry_seconds=600), checks=tuple(gpus))
    await harness.until(lambda: harness.api.condition("GpuUnhealthy") is not None, "condition")
    condition = harness.api.condition("GpuUnhealthy")
    assert condition["status"] == "True" and condition["reason"] == "PreflightFailed"
    assert "7 GPUs visible, 8 expected" in condition["message"]
    assert tainted(harness) and "PreflightFailed" in harness.event_reasons()
    await harness.advance(601)
    await harness.until(lambda: not tainted(harness), "taint removed on the second try")
    await harness.until(lambda: harness.api.condition("GpuUnhealthy")["status"] == "False", "condition cleared")
    await harness.verdict(HEALTHY)
    assert harness.api.condition("GpuUnhealthy")["reason"] == "GpuHealthy"


async def test_no_taint_at_start_means_no_preflight(harness: Harness):
    ran = []

    async def check() -> CheckResult:
        ran.append(1)
        return CheckResult("x", False)
    await harness.start(make_config(preflight_taint=KEY), checks=(check,))
    await harness.advance(1000)
    assert ran == [] and harness.writes() == []


async def test_dry_run_preflight_keeps_the_taint(harness: Harness):
    harness.api.admin_patch({"spec": {"taints": [{"key": KEY, "effect": "NoSchedule"}]}})
    await harness.start(make_config(preflight_taint=KEY, dry_run=True), checks=(fixed("ok", True),))
    await harness.until(lambda: "PreflightPassed" in harness.event_reasons(), "dry-run event")
    assert tainted(harness)


async def test_operator_command_runs_as_argv_with_a_timeout():
    ok = await command_check([sys.executable, "-c", "print('fine')"], 10)()
    assert ok.ok and "fine" in ok.detail
    bad = await command_check([sys.executable, "-c", "import sys; sys.exit(3)"], 10)()
    assert not bad.ok and "exited 3" in bad.detail
    slow = await command_check([sys.executable, "-c", "import time; time.sleep(30)"], 0.3)()
    assert not slow.ok and "timed out" in slow.detail
    missing = await command_check(["/nonexistent/preflight"], 1)()
    assert not missing.ok and "cannot start" in missing.detail
    semicolon = await command_check([sys.executable, "-c", "import sys; print(sys.argv[1])", "a; rm -rf /"], 10)()
    assert semicolon.ok and "a; rm -rf /" in semicolon.detail  # an argument, never a shell


async def test_a_check_that_raises_fails_preflight():
    async def broken() -> CheckResult:
        raise RuntimeError("NVML gone")
    results = await run_checks([broken, fixed("fine", True)])
    assert [r.ok for r in results] == [False, True] and "NVML gone" in results[0].detail
