"""Preflight: a node that starts with the preflight taint keeps it until active checks pass.

Nodes register with a startup taint (kubelet `--register-with-taints`, Karpenter `startupTaints`, AKS
`nodeInitializationTaints`); the agent tolerates it, runs the checks and the engine removes the taint on
success (nidhogg, Cilium's agent-not-ready). On failure the taint stays and the condition says why. Checks are
injected callables, so the health subsystem supplies the hardware probes (no pending row remap, no
uncorrectable ECC, NIC links up) and tests supply fakes; this module adds the GPU-count check and the
operator's command, run through `agent.host.command` (an argv list, never a shell, with a timeout).
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from agent.clock import Clock
from agent.host.command import run_command

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome; `detail` says what was wrong (or seen)."""

    name: str
    ok: bool
    detail: str = ""


PreflightCheck = Callable[[], Awaitable[CheckResult]]


def probe_check(name: str, probe: Callable[[], tuple[bool, str]]) -> PreflightCheck:
    """A check from a blocking probe (NVML, sysfs) run in a worker thread; it returns (ok, detail)."""
    async def check() -> CheckResult:
        ok, detail = await asyncio.to_thread(probe)
        return CheckResult(name, ok, detail)
    return check


def gpu_count_check(count: Callable[[], int], expected: int) -> PreflightCheck:
    """The node shows exactly `expected` GPUs."""
    def probe() -> tuple[bool, str]:
        seen = count()
        return seen == expected, f"{seen} GPUs visible, {expected} expected"
    return probe_check("GpuCount", probe)


def command_check(argv: Sequence[str], timeout: float) -> PreflightCheck:
    """The operator's command exits 0 within `timeout` seconds; argv only, no shell."""
    async def check() -> CheckResult:
        outcome = await run_command(argv, timeout)
        if outcome.timed_out:
            return CheckResult("Command", False, f"command {shlex.join(argv)[:160]!r} timed out after {timeout:g}s "
                                                 "(its process group was killed)")
        if outcome.returncode is None:
            return CheckResult("Command", False, f"cannot start {argv[0]}: {outcome.error}")
        tail = outcome.output.strip()[-200:]
        return CheckResult("Command", outcome.returncode == 0, f"{argv[0]} exited {outcome.returncode}: {tail}")
    return check


def build_checks(*, expected_gpus: int = 0, gpu_count: Callable[[], int] | None = None,
                 command: Sequence[str] = (), command_timeout: float = 300.0,
                 extra: Sequence[PreflightCheck] = ()) -> list[PreflightCheck]:
    """The configured checks: GPU count (when expected > 0 and a counter is given), `extra`, then the command."""
    checks: list[PreflightCheck] = []
    if expected_gpus > 0 and gpu_count is not None:
        checks.append(gpu_count_check(gpu_count, expected_gpus))
    checks.extend(extra)
    if command:
        checks.append(command_check(list(command), command_timeout))
    return checks


async def run_checks(checks: Sequence[PreflightCheck]) -> list[CheckResult]:
    """Run every check in turn; a check that raises counts as failed."""
    results = []
    for index, check in enumerate(checks):
        try:
            results.append(await check())
        except Exception as exc:  # a broken probe must fail preflight, not the agent
            results.append(CheckResult(getattr(check, "__name__", f"check{index}"), False, f"raised {exc!r}"))
    return results


@dataclass
class PreflightState:
    """What the engine needs: whether preflight applies, and its latest result."""

    active: bool = False
    passed: bool = False
    failure: str = ""


async def run_preflight(checks: Sequence[PreflightCheck], state: PreflightState, clock: Clock, *,
                        stop: asyncio.Event, retry_seconds: float, changed: Callable[[], None]) -> None:
    """Run the checks until they pass (retrying every `retry_seconds`, 0: once); report through `state`."""
    while not stop.is_set():
        results = await run_checks(checks)
        failed = [r for r in results if not r.ok]
        for result in results:
            log.info("preflight %s: %s (%s)", result.name, "pass" if result.ok else "FAIL", result.detail)
        state.passed = not failed
        state.failure = "; ".join(f"{r.name}: {r.detail}" for r in failed)
        changed()
        if not failed or retry_seconds <= 0:
            return
        await clock.wait(stop, retry_seconds)
