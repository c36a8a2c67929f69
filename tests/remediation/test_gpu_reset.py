"""The GPU reset step against the HTTP API double, the stand-in kubelet serving PodResources, the real health
assessor (Xid 95: NVIDIA's catalog says RESET_GPU, the default action isolates the device), simulated NVML (the
GPU's processes) and a real reset command run as a process.

Done when (issue "remediation that fits training jobs"): a reset-able fault runs the reset command once the GPU
is idle and the device returns; a failed reset escalates to the reboot step; the record survives a restart.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.config.remediation import RemediationConfig
from agent.host.gpu_reset import GpuResetter
from agent.host.nvml import SimulatedNvml
from agent.remediation.gpu_reset import ESCALATION_REASON
from agent.signals import GpuRecoveryAction, Severity
from agent.simulate import profiles
from tests.remediation.conftest import NODE, Harness, make_config
from tests.remediation.rig import Rig
from tests.remediation.test_drain import P, evictions

BOOT_A, BOOT_B = "11111111-aaaa-4bbb-8ccc-000000000001", "22222222-aaaa-4bbb-8ccc-000000000002"
RECORD = f"{P}/gpu-reset"
HISTORY = f"{P}/remediation-history"

# The reset command's stand-in (nvidia-smi --gpu-reset -i <uuid>): appends its arguments to runs.jsonl, then exits
# with the code in exit-code (0 when absent); with a file "hold" present it waits until the file is removed.
_SCRIPT = """
import json, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
with (out / "runs.jsonl").open("a") as runs:
    runs.write(json.dumps(sys.argv[2:]) + "\\n")
while (out / "hold").exists():
    time.sleep(0.01)
code = out / "exit-code"
sys.exit(int(code.read_text()) if code.exists() else 0)
"""


class Host:
    """The node's side of a reset: simulated NVML, the reset command, the boot id; wires health's reset hook."""

    def __init__(self, directory: Path, rig: Rig) -> None:
        self.dir = directory
        self.rig = rig
        self.nvml = SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids)
        script = directory / "reset.py"
        script.write_text(_SCRIPT)
        self.command = [sys.executable, str(script), str(directory), "--gpu-reset", "-i", "{uuid}"]
        self.boot = directory / "boot_id"
        self.boot.write_text(BOOT_A + "\n")
        self.clears = True  # False: the fault outlives the reset (health keeps asking)
        self.unhealthy_while_resetting: list[set[str]] = []  # device health as an advised reset starts
        self.resets_told: list[str] = []  # the GPUs remediation told health it reset, in order

    def config(self, **overrides: object) -> RemediationConfig:
        base: dict[str, object] = {"gpu_reset_command": self.command, "gpu_reset_timeout_seconds": 10.0}
        return make_config(**{**base, **overrides})

    def runs(self) -> list[list[str]]:
        path = self.dir / "runs.jsonl"
        complete = path.read_text().split("\n")[:-1] if path.exists() else []  # a line still being written: not yet
        return [json.loads(line) for line in complete]

    async def start(self, harness: Harness, config: RemediationConfig, *, restart: bool = False) -> None:
        kwargs = {"boot_id_path": str(self.boot), "resetter": GpuResetter(self.nvml, config.gpu_reset_command, 10.0),
                  "pods_of": self.rig.ownership.pods_holding_now, "reset_listener": HealthOf(self, harness)}
        await (harness.restart(config, **kwargs) if restart else harness.start(config, **kwargs))
        if self.rig.kubelet_calls not in harness.activity:
            harness.activity.append(self.rig.kubelet_calls)


class HealthOf:
    """What HealthService does when remediation tells it about a reset, on the real assessor (a GpuResetListener)."""

    def __init__(self, host: Host, harness: Harness) -> None:
        self.host, self.harness = host, harness

    def gpu_reset_done(self, uuid: str) -> None:
        self.host.resets_told.append(uuid)
        if self.host.clears:
            self.host.rig.assessor.on_gpu_reset(uuid, "reset by remediation")
        self.host.nvml.reset_gpu(uuid)
        self.harness.queue.set(self.host.rig.assessor.verdict)

    def gpu_reset_starting(self, uuid: str) -> None:
        self.host.rig.assessor.on_gpu_resetting(uuid)
        self.host.unhealthy_while_resetting.append(set(self.host.rig.assessor.book.unhealthy_devices()))

    def gpu_reset_abandoned(self, uuid: str) -> None:
        self.host.rig.assessor.on_gpu_reset_abandoned(uuid)


@pytest.fixture
async def host(tmp_path: Path, rig: Rig) -> AsyncIterator[Host]:
    yield Host(tmp_path, rig)


async def _fault(harness: Harness, rig: Rig, pods: int = 4) -> tuple[dict[str, int], str]:
    """Pods on the first GPUs, Xid 95 on trainer-2's GPU; returns the pods and that GPU's UUID."""
    held = await rig.run_pods(harness, [f"trainer-{i}" for i in range(pods)])
    verdict = rig.xid(held["trainer-2"], 95)
    uuid = rig.gpus[held["trainer-2"]]
    assert verdict.severity is Severity.ISOLATE
    assert [(r.gpu_uuid, r.action) for r in verdict.recovery] == [(uuid, GpuRecoveryAction.GPU_RESET)]
    await harness.verdict(verdict)
    return held, uuid


async def _pod_gone(harness: Harness, rig: Rig, name: str) -> None:
    rig.kubelet.end_pod("ml", name)  # evicted in the API double; the kubelet lets it go too
    await rig.ownership.refresh()
    await harness.advance(11)


async def test_the_reset_runs_once_the_gpu_is_idle_and_the_device_returns(harness: Harness, rig: Rig,
                                                                          host: Host) -> None:
    await host.start(harness, host.config())
    _, uuid = await _fault(harness, rig)
    assert evictions(harness) == ["trainer-2"] and host.runs() == []
    host.nvml.set_processes(uuid, [4242])  # a process outside Kubernetes still uses the GPU
    await _pod_gone(harness, rig, "trainer-2")
    assert harness.api.annotations[f"{P}/isolate-drain"] == "complete"
    assert host.runs() == []
    waiting = [e["message"] for e in harness.api.events.values() if e["reason"] == "GpuResetWaiting"]
    assert waiting and "processes 4242 use it" in waiting[0]

    host.nvml.set_processes(uuid, [])
    await harness.advance(16)  # the next look at the GPU
    await harness.until(lambda: "GpuResetVerified" in harness.event_reasons(), "the reset verified")
    assert host.runs() == [["--gpu-reset", "-i", uuid]]
    assert harness.actions("gpu_reset", "ok") == 1 and harness.actions("gpu_reset", "verified") == 1
    assert host.nvml.suspensions == 1 and not host.nvml.suspended
    assert rig.assessor.book.unhealthy_devices() == {}  # back in ListAndWatch
    assert f"{P}/isolated-devices" not in harness.api.annotations and RECORD not in harness.api.annotations
    assert harness.api.condition("GpuUnhealthy")["status"] == "False"
    assert not harness.api.node["spec"].get("unschedulable")
    assert len(harness.api.annotations[HISTORY].split(",")) == 1  # the attempt counts towards the latch
    assert sorted(evictions(harness)) == ["trainer-2"]  # the other GPUs' pods never noticed


async def test_a_pending_remap_is_applied_by_a_reset_once_the_gpu_is_idle(harness: Harness, rig: Rig,
                                                                           host: Host) -> None:
    """Issue 26: Xid 63 is an advisory. Nobody is evicted and the GPU stays in service while its pod runs; once the
    pod ends by itself the GPU is reset (Unhealthy only meanwhile), the advisory ends, and nothing is cordoned or
    counted towards the latch."""
    await host.start(harness, host.config())
    held = await rig.run_pods(harness, ["trainer-0", "trainer-1"])
    uuid = rig.gpus[held["trainer-1"]]
    verdict = rig.xid(held["trainer-1"], 63)
    assert verdict.severity is Severity.HEALTHY and verdict.reset_advised == (uuid,)
    await harness.verdict(verdict)
    assert host.runs() == [] and evictions(harness) == []
    assert rig.assessor.book.unhealthy_devices() == {}
    waiting = [e["message"] for e in harness.api.events.values() if e["reason"] == "GpuResetWaiting"]
    assert waiting and "ml/trainer-1" in waiting[0]

    rig.kubelet.end_pod("ml", "trainer-1")  # the job ends by itself
    await harness.advance(16)  # the next look
    await harness.until(lambda: "GpuResetVerified" in harness.event_reasons(), "the advised reset verified")
    assert host.runs() == [["--gpu-reset", "-i", uuid]]
    assert host.unhealthy_while_resetting == [{uuid}]  # out of ListAndWatch for the reset only ...
    assert rig.assessor.book.unhealthy_devices() == {} and rig.assessor.verdict.reset_advised == ()  # ... back
    assert evictions(harness) == [] and not harness.api.node["spec"].get("unschedulable")
    assert HISTORY not in harness.api.annotations  # routine maintenance: not counted towards the latch
    assert harness.actions("gpu_reset", "ok") == 1


async def test_a_failed_reset_cordons_drains_and_requests_a_reboot(harness: Harness, rig: Rig,
                                                                  host: Host) -> None:
    sentinel = host.dir / "reboot-required"
    await host.start(harness, host.config(reboot_sentinel_path=str(sentinel), reboot_sentinel_dir=str(host.dir)))
    (host.dir / "exit-code").write_text("3")
    _, uuid = await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    await harness.until(lambda: ESCALATION_REASON in harness.event_reasons(), "the reset failed")
    await harness.settle()
    assert harness.actions("gpu_reset", "failed") == 1
    failed = next(e["message"] for e in harness.api.events.values() if e["reason"] == ESCALATION_REASON)
    assert "exited 3 (operation not available on this GPU)" in failed
    assert json.loads(harness.api.annotations[RECORD])["gpus"][uuid]["state"] == "failed"
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.api.annotations[f"{P}/cordon-reason"] == ESCALATION_REASON
    for name in ("trainer-0", "trainer-1", "trainer-3"):
        rig.kubelet.end_pod("ml", name)
    await harness.advance(11)
    assert sorted(evictions(harness)) == [f"trainer-{i}" for i in range(4)]
    assert sentinel.exists() and ESCALATION_REASON in sentinel.read_text()
    assert len(harness.api.annotations[HISTORY].split(",")) == 2  # the reset and the reboot request
    assert host.runs() == [["--gpu-reset", "-i", uuid]]  # tried once


async def test_a_fault_that_outlives_the_reset_fails_it_after_the_verify_window(harness: Harness,
                                                                                 rig: Rig,
                                                                                 host: Host) -> None:
    host.clears = False
    await host.start(harness, host.config(gpu_reset_verify_seconds=300))
    _, uuid = await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    await harness.until(lambda: "GpuReset" in harness.event_reasons(), "the reset ran")
    await harness.settle()
    assert harness.actions("gpu_reset", "ok") == 1 and not harness.api.node["spec"].get("unschedulable")
    await harness.advance(301)
    assert harness.actions("gpu_reset", "failed") == 1
    failed = next(e["message"] for e in harness.api.events.values() if e["reason"] == ESCALATION_REASON)
    assert "still failing 300 s after the reset" in failed
    assert harness.api.node["spec"]["unschedulable"] is True  # no reboot step: cordon only
    assert sorted(evictions(harness)) == ["trainer-2"]
    assert host.runs() == [["--gpu-reset", "-i", uuid]]


async def test_an_agent_restart_during_the_reset_counts_it_failed(harness: Harness, rig: Rig,
                                                                  host: Host) -> None:
    (host.dir / "hold").write_text("")
    config = host.config()
    await host.start(harness, config)
    _, uuid = await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    await harness.until(lambda: host.runs() != [], "the reset command started")
    assert json.loads(harness.api.annotations[RECORD])["gpus"][uuid]["state"] == "running"
    await host.start(harness, config, restart=True)  # the old process's command is killed with it
    await harness.verdict(rig.assessor.verdict)
    record = json.loads(harness.api.annotations[RECORD])
    assert record["boot"] == BOOT_A and record["gpus"][uuid]["state"] == "failed"
    assert "restarted while the reset ran" in record["gpus"][uuid]["detail"]
    assert harness.api.node["spec"]["unschedulable"] is True
    assert host.runs() == [["--gpu-reset", "-i", uuid]]  # not tried again in this boot


async def test_a_new_boot_forgets_a_failed_reset_and_may_try_again(harness: Harness, rig: Rig,
                                                                   host: Host) -> None:
    (host.dir / "exit-code").write_text("15")
    config = host.config()
    await host.start(harness, config)
    await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    await harness.until(lambda: ESCALATION_REASON in harness.event_reasons(), "the reset failed")
    await harness.settle()
    assert harness.api.node["spec"]["unschedulable"] is True

    (host.dir / "exit-code").unlink()
    host.boot.write_text(BOOT_B + "\n")  # the node rebooted; the GPU's fault came back after it
    await host.start(harness, config, restart=True)
    await harness.verdict(rig.assessor.verdict)
    await harness.advance(16)
    await harness.until(lambda: len(host.runs()) == 2, "the reset tried in the new boot")
    await harness.until(lambda: RECORD not in harness.api.annotations, "the reset verified")
    assert harness.actions("gpu_reset", "ok") == 1


@pytest.mark.parametrize("exit_code", [0, 3])
async def test_a_reset_outcome_whose_write_fails_is_recorded_on_the_next_pass(harness: Harness, rig: Rig,
                                                                             host: Host, exit_code: int) -> None:
    """The API server fails the write of the reset's outcome (under load: a request past the client's timeout).
    The outcome is written on the next pass, and health hears of the reset once; it was dropped with its task and
    the record said "running" for the rest of the boot: never verified, never escalated."""
    (host.dir / "hold").write_text("")
    if exit_code:
        (host.dir / "exit-code").write_text(str(exit_code))
    await host.start(harness, host.config())
    _, uuid = await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    await harness.until(lambda: host.runs() != [], "the reset command started")
    harness.api.fail("PATCH", f"/nodes/{NODE}$", 500)  # the next write of the node: the outcome's
    (host.dir / "hold").unlink()
    await harness.until(lambda: harness.api_count("patch", "500") == 1, "the outcome's write refused")
    await harness.settle()  # the retry's back-off is scheduled on the clock ...
    await harness.advance(2)  # ... and passes
    if exit_code:
        await harness.until(lambda: harness.actions("gpu_reset", "failed") == 1, "the failure recorded")
        assert json.loads(harness.api.annotations[RECORD])["gpus"][uuid]["state"] == "failed"
        await harness.until(lambda: harness.api.node["spec"].get("unschedulable") is True, "the escalation")
        assert host.resets_told == []
    else:
        await harness.until(lambda: RECORD not in harness.api.annotations, "the reset verified")
        assert harness.actions("gpu_reset", "ok") == 1 and harness.actions("gpu_reset", "verified") == 1
        assert host.resets_told == [uuid]
    assert host.runs() == [["--gpu-reset", "-i", uuid]]


async def test_no_reset_without_a_command_on_a_latched_node_or_in_dry_run(harness: Harness,
                                                                          rig: Rig,
                                                                          host: Host) -> None:
    await host.start(harness, host.config(gpu_reset_command=[]))
    await _fault(harness, rig)
    await _pod_gone(harness, rig, "trainer-2")
    assert host.runs() == [] and RECORD not in harness.api.annotations

    harness.api.annotations[f"{P}/needs-human-attention"] = "3 remediations within 7 days"
    await host.start(harness, host.config(), restart=True)
    await harness.verdict(rig.assessor.verdict)
    await harness.advance(16)
    assert host.runs() == []

    del harness.api.annotations[f"{P}/needs-human-attention"]
    await host.start(harness, host.config(dry_run=True), restart=True)
    await harness.verdict(rig.assessor.verdict)
    await harness.advance(16)
    assert host.runs() == [] and harness.actions("gpu_reset", "dry_run") == 1
    assert "GpuResetDryRun" in harness.event_reasons()
