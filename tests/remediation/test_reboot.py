"""Reboot requests against the HTTP API double and the fake clock: kured's sentinel written after the cordon and
the drain, a NodeCondition for NodeHealthCheck/Karpenter that never flaps, once per boot, cleared by a reboot (a
new boot id), counted towards the needs-a-human latch; and the Xid catalog's reboot faults reaching the verdict."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent import cli
from agent import config as agent_config
from agent.config.load import ConfigError, from_mapping
from agent.config.remediation import DrainRule, RemediationConfig
from agent.health.xid import XidPolicy
from agent.signals import GpuRecoveryAction, NodeVerdict, RecoveryRequest, Severity
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_drain import P, evictions

REBOOT = NodeVerdict(Severity.DRAIN, "GpuXid79", "GPU fell off the bus", ("GPU-1",), hardware=True,
                     recovery=(RecoveryRequest("GPU-1", GpuRecoveryAction.NODE_REBOOT),))
RESET_ONLY = NodeVerdict(Severity.DRAIN, "GpuXid119", "GSP timeout", ("GPU-2",), hardware=False,
                         recovery=(RecoveryRequest("GPU-2", GpuRecoveryAction.GPU_RESET),))
BOOT_A, BOOT_B = "11111111-aaaa-4bbb-8ccc-000000000001", "22222222-aaaa-4bbb-8ccc-000000000002"
KIND = "GpuNodeRebootRequired"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """The host's /run as the agent's container sees it through a hostPath mount, and a boot id file."""
    run = tmp_path / "host-run"
    run.mkdir()
    (tmp_path / "boot_id").write_text(BOOT_A + "\n")
    return run


def config_for(host: Path, **overrides: object) -> RemediationConfig:
    return make_config(reboot_sentinel_path=str(host / "reboot-required"), reboot_sentinel_dir=str(host),
                       reboot_condition_type=KIND, **overrides)


def boot_file(host: Path) -> str:
    return str(host.parent / "boot_id")


async def test_sentinel_and_condition_come_after_the_cordon_and_the_drain(harness: Harness, host: Path) -> None:
    harness.api.add_pod("ml", "trainer")
    harness.api.add_pod("long", "job")
    rules = [DrainRule(namespaces=["long"], mode="AllowCompletion")]
    await harness.start(config_for(host, drain_modes=rules), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    sentinel = host / "reboot-required"
    assert harness.api.node["spec"]["unschedulable"] is True and evictions(harness) == ["trainer"]
    assert not sentinel.exists()  # the AllowCompletion pod still runs: the drain is not over
    assert harness.api.condition(KIND) is None

    harness.api.delete_pod("long", "job")  # it finished
    await harness.advance(11)
    assert sentinel.exists() and "GpuXid79" in sentinel.read_text()
    condition = harness.api.condition(KIND)
    assert condition is not None and condition["status"] == "True" and condition["reason"] == "GpuXid79"
    assert harness.actions("reboot_request", "ok") == 1
    assert harness.api.annotations[f"{P}/reboot-requested"].startswith(BOOT_A)
    assert "RebootRequested" in harness.event_reasons()
    paths = [r.path for r in harness.api.requests if r.method == "PATCH"]
    assert paths and harness.api.annotations[f"{P}/drain"] == "complete"

    transition = condition["lastTransitionTime"]
    await harness.advance(3600)  # heartbeats keep it; the transition time (what NHC/Karpenter time) stays
    later = harness.api.condition(KIND)
    assert later is not None and later["status"] == "True" and later["lastTransitionTime"] == transition
    assert harness.actions("reboot_request", "ok") == 1


async def test_one_request_per_boot_and_a_new_boot_clears_it(harness: Harness, host: Path) -> None:
    await harness.start(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    sentinel = host / "reboot-required"
    assert sentinel.exists() and harness.actions("reboot_request", "ok") == 1

    sentinel.unlink()  # e.g. someone removed it by hand: a restarted agent in the same boot does not ask again
    await harness.restart(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    assert not sentinel.exists() and harness.actions("reboot_request", "ok") == 0

    (host.parent / "boot_id").write_text(BOOT_B + "\n")  # the reboot happened (tmpfs /run lost the file)
    harness.queue.set(NodeVerdict(Severity.HEALTHY, "GpuHealthy", "all checks pass"))  # the new boot's health
    await harness.restart(config_for(host), boot_id_path=boot_file(host))
    assert f"{P}/reboot-requested" not in harness.api.annotations
    condition = harness.api.condition(KIND)
    assert condition is not None and condition["status"] == "False" and condition["reason"] == "Rebooted"
    assert harness.actions("reboot_request", "rebooted") == 1 and "RebootCompleted" in harness.event_reasons()


async def test_a_reset_level_fault_asks_for_no_reboot(harness: Harness, host: Path) -> None:
    await harness.start(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(RESET_ONLY)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert not (host / "reboot-required").exists() and harness.actions("reboot_request", "ok") == 0


async def test_reboot_requests_count_towards_the_latch(harness: Harness, host: Path) -> None:
    await harness.start(config_for(host, latch_count=2), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)  # the cordon (1) and the reboot request (2)
    assert harness.actions("latch", "ok") == 1
    assert f"{P}/needs-human-attention" in harness.api.annotations
    assert len(harness.api.annotations[f"{P}/remediation-history"].split(",")) == 2


async def test_a_sentinel_that_cannot_be_written_is_reported_and_retried(harness: Harness, host: Path) -> None:
    missing = host / "not-mounted"
    config = make_config(reboot_sentinel_path=str(missing / "reboot-required"), reboot_sentinel_dir=str(host))
    await harness.start(config, boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    assert harness.actions("reboot_request", "failed") >= 1 and harness.actions("reboot_request", "ok") == 0
    assert f"{P}/reboot-requested" not in harness.api.annotations
    assert [r for r in harness.event_reasons() if r == "RebootRequestFailed"] == ["RebootRequestFailed"]
    missing.mkdir()  # the mount is fixed
    await harness.verdict(REBOOT)
    await harness.advance(301)  # the next pass (condition heartbeat)
    assert (missing / "reboot-required").exists() and harness.actions("reboot_request", "ok") == 1


def test_a_symlink_at_the_sentinel_is_not_followed(tmp_path: Path) -> None:
    from agent.host.sentinel import write_sentinel
    target = tmp_path / "elsewhere"
    (tmp_path / "reboot-required").symlink_to(target)
    with pytest.raises(OSError):
        write_sentinel(tmp_path, tmp_path / "reboot-required", "x")
    assert not target.exists()


@pytest.mark.parametrize("path", ["reboot-required", "/var/run/../etc/passwd", "/var//run/x", "/", "/var/run/"])
def test_an_unsafe_sentinel_path_is_refused_at_load(path: str) -> None:
    with pytest.raises(ConfigError, match="rebootSentinelPath"):
        from_mapping(RemediationConfig, {"rebootSentinelPath": path})


async def test_a_fifo_at_the_sentinel_is_refused_without_blocking(harness: Harness, host: Path) -> None:
    """Issue 27, item 9: open() blocked on the FIFO for ever (no reader), and SIGTERM could not end the agent."""
    os.mkfifo(host / "reboot-required")
    await harness.start(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    await harness.until(lambda: "RebootRequestFailed" in harness.event_reasons(), "the FIFO refused")
    failed = next(e["message"] for e in harness.api.events.values() if e["reason"] == "RebootRequestFailed")
    assert "is a FIFO, not a regular file" in failed
    assert stat.S_ISFIFO((host / "reboot-required").lstat().st_mode)  # left alone, not replaced
    assert f"{P}/reboot-requested" not in harness.api.annotations and harness.actions("reboot_request", "ok") == 0


async def test_a_symlinked_parent_directory_is_refused(harness: Harness, host: Path, tmp_path: Path) -> None:
    """Issue 27, item 9: a symlinked directory under the allowed one led the write anywhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (host / "kured").symlink_to(elsewhere)
    config = make_config(reboot_sentinel_path=str(host / "kured" / "reboot-required"), reboot_sentinel_dir=str(host))
    await harness.start(config, boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    await harness.until(lambda: "RebootRequestFailed" in harness.event_reasons(), "the symlink refused")
    assert list(elsewhere.iterdir()) == [] and harness.actions("reboot_request", "ok") == 0


async def test_an_existing_file_is_never_overwritten(harness: Harness, host: Path) -> None:
    """Issue 27, item 9: an existing file was truncated and rewritten. A regular file already there asks kured
    for the reboot already: the request stands and the file keeps its content."""
    sentinel = host / "reboot-required"
    sentinel.write_text("unattended-upgrades: linux-image\n")
    await harness.start(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    assert sentinel.read_text() == "unattended-upgrades: linux-image\n"
    assert harness.actions("reboot_request", "ok") == 1 and "RebootRequested" in harness.event_reasons()


def test_the_writer_refuses_paths_outside_its_directory_and_devices(tmp_path: Path) -> None:
    from agent.host.sentinel import write_sentinel
    with pytest.raises(OSError, match="not under the allowed directory"):
        write_sentinel(tmp_path / "run", "/etc/passwd", "x")
    with pytest.raises(OSError, match="a character device"):
        write_sentinel("/dev", "/dev/null", "x")
    assert write_sentinel(tmp_path, tmp_path / "reboot-required", "why\n") is True
    assert write_sentinel(tmp_path, tmp_path / "reboot-required", "again\n") is False
    assert (tmp_path / "reboot-required").read_text() == "why\n"


@pytest.mark.parametrize(("argv", "named"), [
    (["--reboot-sentinel=/etc/passwd"], "is not under rebootSentinelDir '/var/lib/gpu-node-agent'"),
    (["--reboot-sentinel=/proc/sysrq-trigger", "--reboot-sentinel-dir=/proc"], "rebootSentinelDir: '/proc'"),
    (["--reboot-sentinel=/etc/passwd", "--reboot-sentinel-dir=/etc"], "rebootSentinelDir: '/etc'"),
    (["--reboot-sentinel=/host/run/x/reboot-required", "--reboot-sentinel-dir=/host/run/gpu-node-agent"],
     "is not under rebootSentinelDir '/host/run/gpu-node-agent'"),
    (["--reboot-sentinel=/var/lib/gpu-node-agent"], "is not under rebootSentinelDir"),
])
def test_a_sentinel_outside_the_allowed_directory_is_exit_2_with_one_line(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_the_sentinel_directory_defaults_to_the_state_directory() -> None:
    cfg = agent_config.load(None, {"GPU_NODE_AGENT_STATE_DIR": "/data/gna",
                                   "GPU_NODE_AGENT_REBOOT_SENTINEL": "/data/gna/reboot-required"})
    assert cfg.remediation.reboot_sentinel_dir == "/data/gna"


def test_the_catalog_and_the_lost_gpu_carry_a_reboot() -> None:
    policy = XidPolicy()
    assert policy.recovery(79) is GpuRecoveryAction.NODE_REBOOT
    assert policy.recovery(119) is GpuRecoveryAction.GPU_RESET
    assert policy.recovery(13) is None and policy.recovery(999) is None


async def test_a_condition_type_no_longer_set_is_removed_at_start(harness: Harness, host: Path) -> None:
    await harness.start(config_for(host), boot_id_path=boot_file(host))
    await harness.verdict(REBOOT)
    assert harness.api.condition(KIND)["status"] == "True"  # type: ignore[index]
    assert harness.api.annotations[f"{P}/condition-types"] == f"{KIND},GpuUnhealthy"

    # the operator turns the reboot condition off: left as it is, the True would make NHC/Karpenter act at once
    await harness.restart(make_config(reboot_sentinel_path=str(host / "reboot-required"),
                                      reboot_sentinel_dir=str(host)), boot_id_path=boot_file(host))
    assert harness.api.condition(KIND) is None
    assert harness.api.condition("GpuUnhealthy") is not None and harness.api.condition("Ready") is not None
    assert harness.actions("condition_removed", "ok") == 1 and "StaleConditionRemoved" in harness.event_reasons()
    assert harness.api.annotations[f"{P}/condition-types"] == "GpuUnhealthy"


async def test_an_older_versions_condition_goes_when_the_type_is_renamed(harness: Harness) -> None:
    await harness.start()
    await harness.verdict(NodeVerdict(Severity.HEALTHY, "GpuHealthy", "all checks pass"))
    assert harness.api.condition("GpuUnhealthy") is not None
    assert f"{P}/condition-types" not in harness.api.annotations  # the default needs no record: no extra write
    await harness.restart(make_config(condition_type="AcmeGpuProblem"))
    assert harness.api.condition("GpuUnhealthy") is None
    assert harness.api.condition("AcmeGpuProblem") is not None
