"""Preflight: the startup taint goes only when the checks pass; failures keep it and set the condition."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from agent.remediation.preflight import CheckResult, build_checks, command_check, run_checks
from tests.fakes.polling import until, until_blocking
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, merely not yet reaped by its new parent
        return stat.read().split(") ", 1)[1][0] != "Z"


async def test_a_command_that_hangs_with_a_background_child_times_out_and_the_group_is_killed(tmp_path):
    """The background `sleep` inherits stdout: asyncio's wait() used to wait for that pipe, so the timeout never
    reported and the children were orphaned."""
    pid_file = tmp_path / "child.pid"
    argv = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; echo started; sleep 300"]
    slow = await asyncio.wait_for(command_check(argv, 0.5)(), 30)
    assert not slow.ok and "timed out after 0.5s" in slow.detail and "sleep 300 &" in slow.detail
    child = int(pid_file.read_text())
    await until(lambda: not _alive(child), "the background child killed with its group", timeout=30)


async def test_a_command_that_exits_but_leaves_a_child_reports_its_exit_and_the_child_goes(tmp_path):
    pid_file = tmp_path / "child.pid"
    argv = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; echo done"]
    result = await asyncio.wait_for(command_check(argv, 30)(), 30)
    assert result.ok and "exited 0: done" in result.detail
    await until(lambda: not _alive(int(pid_file.read_text())), "the background child killed", timeout=30)


async def test_stopping_during_the_command_kills_its_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    argv = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"]
    task = asyncio.create_task(command_check(argv, 3600)())
    await until(lambda: pid_file.exists() and pid_file.read_text().strip() != "", "the command's background child",
                timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    child = int(pid_file.read_text())
    await until(lambda: not _alive(child), "the background child killed with its group", timeout=30)


def _children() -> set[int]:
    """Our processes' children: a command shows here the moment asyncio has forked it."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, ppid = stat.read().rsplit(") ", 1)[1].split()[:2]
        except (OSError, IndexError):  # not a process, or one that just ended
            continue
        if int(ppid) == me and state != "Z":
            found.add(int(entry))
    return found


async def test_stopping_while_the_command_starts_kills_what_it_started(tmp_path):
    """asyncio forks the command, then hands it over a few loop turns later; a stop that came in between used to
    leave the command's background children running (asyncio killed the shell alone) and the pipe open."""
    pid_file = tmp_path / "child.pid"
    argv = ["sh", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"]
    fds, before = set(os.listdir("/proc/self/fd")), _children()
    task = asyncio.create_task(command_check(argv, 3600)())
    for _ in range(100):  # one loop turn at a time, to stop right after the fork
        await asyncio.sleep(0)
        if started := _children() - before:
            break
    assert started, "the command was never forked"
    # The loop stands still while the shell starts its background child: the start is not handed over yet.
    until_blocking(lambda: pid_file.exists() and pid_file.read_text().strip() != "",
                   "the command's background child", timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)
    for pid in (*started, int(pid_file.read_text())):
        await until(lambda pid=pid: not _alive(pid), f"process {pid} of the command killed", timeout=30)
    assert set(os.listdir("/proc/self/fd")) == fds, "the output pipe was left open"
