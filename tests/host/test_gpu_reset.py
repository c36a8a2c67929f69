"""Resetting one GPU: the command's placeholders, what blocks a reset, and the reset itself as a real process run
while the (simulated) NVML session is closed."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agent.config.remediation import check_reset_command
from agent.host.gpu_reset import GpuResetter, ResetTarget, reset_argv
from agent.host.nvml import SimulatedNvml
from tests.fakes.polling import until

BUS = {"0000:3b:00.0": "GPU-11111111-2222-3333-4444-555555555555",
       "0000:1a:00.0": "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"}
SECOND = BUS["0000:3b:00.0"]  # index 1: the second GPU in PCI bus order

# A stand-in for `nvidia-smi --gpu-reset -i <id>`: records its arguments, says it started, optionally waits for
# the test to look, then exits with the code asked for.
_RESET_SCRIPT = """
import json, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / "argv.json").write_text(json.dumps(sys.argv[2:]))
(out / "started").write_text("")
while not (out / "go").exists():
    time.sleep(0.01)
print("GPU 00000000:3B:00.0 was successfully reset.")
sys.exit(int((out / "go").read_text() or 0))
"""


def _command(tmp_path: Path) -> list[str]:
    script = tmp_path / "reset.py"
    script.write_text(_RESET_SCRIPT)
    return [sys.executable, str(script), str(tmp_path), "--gpu-reset", "-i", "{uuid}", "bus={busId}",
            "index={index}"]


def test_placeholders_are_filled_with_checked_values_only() -> None:
    target = ResetTarget(SECOND, "0000:3b:00.0", 1)
    assert reset_argv(["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "{busId}/{index}"], target) == \
        ["nvidia-smi", "--gpu-reset", "-i", SECOND, "0000:3b:00.0/1"]
    for bad in (ResetTarget("GPU-1; rm -rf /", "0000:3b:00.0", 1), ResetTarget(SECOND, "3b:00", 1),
                ResetTarget(SECOND, "0000:3b:00.0", -1)):
        with pytest.raises(ValueError, match="refusing"):
            reset_argv(["nvidia-smi", "{uuid}"], bad)


@pytest.mark.parametrize("argv, problem", [(["{uuid}", "-r"], "program"), (["", "-r"], "program"),
                                           (["nvidia-smi", "-i", "{pid}"], "brace"),
                                           (["nvidia-smi", "-i", "{uuid"], "brace")])
def test_a_reset_command_with_a_variable_program_or_an_unknown_placeholder_is_refused(argv: list[str],
                                                                                       problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_reset_command(argv)
    check_reset_command(["nvidia-smi", "--gpu-reset", "-i", "{uuid}", "{busId}", "{index}"])


def test_blockers_processes_can_end_mig_lost_and_unlisted_gpus_cannot() -> None:
    nvml = SimulatedNvml(BUS, mig=["0000:1a:00.0"])
    resetter = GpuResetter(nvml, ["nvidia-smi"], 10)
    assert resetter.blockers(SECOND) == ([], True)
    nvml.set_processes(SECOND, [4242, 17])
    assert resetter.blockers(SECOND) == (["processes 17, 4242 use it"], True)
    nvml.lose_gpu(SECOND)
    why, can_wait = resetter.blockers(SECOND)
    assert "lost" in why[0] and not can_wait
    why, can_wait = resetter.blockers(BUS["0000:1a:00.0"])
    assert "MIG" in why[0] and not can_wait
    why, can_wait = resetter.blockers("GPU-00000000-0000-0000-0000-000000000000")
    assert "does not list" in why[0] and not can_wait


async def test_the_command_runs_with_the_nvml_session_closed_and_the_gpu_must_be_listed_again(
        tmp_path: Path) -> None:
    nvml = SimulatedNvml(BUS)
    resetter = GpuResetter(nvml, _command(tmp_path), 10)
    target = await asyncio.to_thread(resetter.target, SECOND)
    assert target == ResetTarget(SECOND, "0000:3b:00.0", 1)
    running = asyncio.create_task(resetter.reset(target))
    await until((tmp_path / "started").exists, "the reset command started")
    assert nvml.suspended  # nothing of the agent's holds the GPU while the command runs
    (tmp_path / "go").write_text("0")
    outcome = await running
    assert outcome.ok and "successfully reset" in outcome.detail
    assert json.loads((tmp_path / "argv.json").read_text()) == ["--gpu-reset", "-i", SECOND, "bus=0000:3b:00.0",
                                                                "index=1"]
    assert not nvml.suspended and nvml.suspensions == 1


async def test_a_failing_timed_out_or_missing_command_fails_the_reset_and_reopens_the_session(
        tmp_path: Path) -> None:
    nvml = SimulatedNvml(BUS)
    target = ResetTarget(SECOND, "0000:3b:00.0", 1)
    (tmp_path / "go").write_text("3")
    failed = await GpuResetter(nvml, _command(tmp_path), 10).reset(target)
    assert not failed.ok and "exited 3 (operation not available on this GPU)" in failed.detail
    (tmp_path / "go").unlink()
    slow = await GpuResetter(nvml, _command(tmp_path), 0.5).reset(target)
    assert not slow.ok and "timed out after" in slow.detail
    missing = await GpuResetter(nvml, [str(tmp_path / "no-such-program")], 10).reset(target)
    assert not missing.ok and "could not start" in missing.detail
    assert not nvml.suspended and nvml.suspensions == 3


async def test_a_gpu_that_nvml_does_not_list_after_the_reset_failed_it(tmp_path: Path) -> None:
    nvml = SimulatedNvml(BUS)
    running = asyncio.create_task(GpuResetter(nvml, _command(tmp_path), 10).reset(
        ResetTarget(SECOND, "0000:3b:00.0", 1)))
    await until((tmp_path / "started").exists, "the reset command started")
    nvml.set_available(False)  # the driver lost the GPU during the reset
    (tmp_path / "go").write_text("0")
    outcome = await running
    assert not outcome.ok and "does not list" in outcome.detail


def test_the_config_file_and_the_environment_give_the_same_command_and_bad_ones_are_refused() -> None:
    from agent import config as agent_config
    from agent.config.load import ConfigError, from_mapping
    from agent.config.remediation import RemediationConfig

    argv = ["nvidia-smi", "--gpu-reset", "-i", "{uuid}"]
    assert from_mapping(RemediationConfig, {"gpuResetCommand": argv}).gpu_reset_command == argv
    env = agent_config.load(None, {"GPU_NODE_AGENT_GPU_RESET_COMMAND": ",".join(argv)})
    assert env.remediation.gpu_reset_command == argv and env.remediation.gpu_resets
    with pytest.raises(ConfigError, match="gpuResetCommand"):
        from_mapping(RemediationConfig, {"gpuResetCommand": ["nvidia-smi", "-r", "-i", "{gpu}"]})
    with pytest.raises(ConfigError, match="gpuResetTimeoutSeconds: must be positive"):
        from_mapping(RemediationConfig, {"gpuResetCommand": argv, "gpuResetTimeoutSeconds": 0})
