"""NVLink inactive links, NVSwitch fabric state and the driver's GPU recovery action: the rules on plain values,
then through the simulated NVML twin and the whole health service (device health, node verdict, metrics, the
fail-safe when a part cannot be read)."""

from __future__ import annotations

import json

import pytest

from agent.config.health import CHECK_ACTIONS, HealthConfig
from agent.health.findings import GpuRef
from agent.health.gpu_state import GpuStateJudge
from agent.host.nvml import GpuFabric, GpuState, SimulatedNvml
from agent.host.nvml.api import FABRIC_COMPLETED, FABRIC_IN_PROGRESS, FABRIC_NOT_STARTED, FABRIC_NOT_SUPPORTED
from agent.signals import GpuRecoveryAction, RecoveryRequest, Severity
from agent.simulate import profiles
from agent.simulate.node import SimulatedNode, build_simulated_node
from tests.fakes.polling import until
from tests.health.conftest import fast_config

ACTIONS = {k: Severity.parse(v) for k, v in CHECK_ACTIONS.items()}
GPUS = [GpuRef(str(i), f"GPU-{i}", f"0000:{0x1b + i:02x}:00.0") for i in range(8)]


def _states(links: int = 18, **changes: dict[int, bool]) -> list[tuple[GpuRef, GpuState]]:
    """Eight GPUs with `links` active NVLinks; `changes` (GPU-i -> {link: active}) alter some."""
    return [(g, GpuState(g.uuid, {**dict.fromkeys(range(links), True), **changes.get(g.uuid.replace("-", "_"), {})}))
            for g in GPUS]


def _keys(findings: list) -> dict[str, str]:
    return {f.key: f.reason for f in findings}


# the rules --------------------------------------------------------------------------------------------------------
def test_nvlink_inactive_against_peers_names_the_gpu_and_links() -> None:
    judge = GpuStateJudge(ACTIONS, 600)
    found = judge.judge(_states(GPU_3={4: False, 7: False}), 0.0)
    assert _keys(found) == {"nvml:nvlink_inactive:GPU-3": "GPU 3 (0000:1e:00.0): NVLink 4, 7 inactive (its peers "
                                                          "have them active)"}
    [finding] = found
    assert finding.devices == ("GPU-3",) and finding.severity is Severity.CORDON and finding.code == "GpuNvlinkInactive"
    assert judge.nvlink["GPU-3"].down == 2 and judge.nvlink["GPU-0"].down == 0
    assert judge.judge(_states(), 0.0) == []


def test_nvlink_links_not_reported_or_fewer_than_peers() -> None:
    judge = GpuStateJudge(ACTIONS, 600)
    short = _states()
    short[5] = (GPUS[5], GpuState("GPU-5", dict.fromkeys(range(16), True)))  # links 16, 17 not even reported
    assert _keys(judge.judge(short, 0.0)) == {
        "nvml:nvlink_inactive:GPU-5": "GPU 5 (0000:20:00.0): NVLink 16, 17 inactive (its peers have them active)"}


@pytest.mark.parametrize("states", [
    [(g, GpuState(g.uuid, {})) for g in GPUS],  # PCIe boards: no NVLink at all
    _states(links=12, **{f"GPU_{i}": dict.fromkeys(range(12), False) for i in range(8)}),  # no bridges anywhere
    _states()[:1],  # one NVLink GPU: no peers to compare with
], ids=["no-nvlink", "all-inactive", "no-peers"])
def test_nvlink_without_peers_to_compare_is_no_finding(states) -> None:
    assert GpuStateJudge(ACTIONS, 600).judge(states, 0.0) == []


def test_fabric_not_completed_is_a_finding_only_after_the_grace_time() -> None:
    judge = GpuStateJudge(ACTIONS, 600)
    gpu = GPUS[2]
    assert judge.fabric(gpu, GpuFabric(FABRIC_NOT_STARTED), 100.0) == []
    assert judge.fabric(gpu, GpuFabric(FABRIC_IN_PROGRESS), 650.0) == []
    [late] = judge.fabric(gpu, GpuFabric(FABRIC_IN_PROGRESS), 700.0)
    assert late.code == "GpuFabricIncomplete" and late.severity is Severity.CORDON and late.devices == ("GPU-2",)
    assert "in progress for over 600 s" in late.reason
    assert judge.fabric(gpu, GpuFabric(FABRIC_COMPLETED), 710.0) == []
    assert judge.fabric(gpu, GpuFabric(FABRIC_IN_PROGRESS), 720.0) == []  # a new streak gets a new grace time
    assert judge.fabric(gpu, None, 2000.0) == []  # NOT_SUPPORTED (the port gives None)


@pytest.mark.parametrize(("fabric", "key", "code", "text"), [
    (GpuFabric(FABRIC_COMPLETED, status=999), "gpu_fabric", "GpuFabricFailed", "registration failed (NVML status 999)"),
    (GpuFabric(FABRIC_COMPLETED, health_summary=2), "gpu_fabric", "GpuFabricUnhealthy", "health summary unhealthy"),
    (GpuFabric(FABRIC_COMPLETED, health_mask=1 << 4), "gpu_fabric", "GpuFabricUnhealthy", "route unhealthy"),
    (GpuFabric(FABRIC_COMPLETED, health_mask=5 << 8), "gpu_fabric", "GpuFabricUnhealthy",
     "incorrect configuration: insufficient NVLinks"),
    (GpuFabric(FABRIC_COMPLETED, health_summary=3), "gpu_fabric_degraded", "GpuFabricDegraded", "limited capacity"),
    (GpuFabric(FABRIC_COMPLETED, health_mask=1), "gpu_fabric_degraded", "GpuFabricDegraded", "bandwidth degraded"),
])
def test_fabric_completed_with_a_failure(fabric, key, code, text) -> None:
    [finding] = GpuStateJudge(ACTIONS, 600).fabric(GPUS[1], fabric, 0.0)
    assert finding.key == f"nvml:{key}:GPU-1" and finding.code == code and text in finding.reason
    assert finding.severity is ACTIONS[key]


def test_fabric_healthy_mask_values_are_no_finding() -> None:
    # every 2-bit flag FALSE (2), configuration NONE (1), partition assigned, GFM connected: a healthy NVL72 tray
    healthy = 2 | 2 << 2 | 2 << 4 | 2 << 6 | 1 << 8 | 1 << 12 | 1 << 14
    assert GpuStateJudge(ACTIONS, 600).fabric(GPUS[0], GpuFabric(FABRIC_COMPLETED, 0, healthy, 1), 0.0) == []


@pytest.mark.parametrize(("value", "action", "severity", "code"), [
    (1, GpuRecoveryAction.GPU_RESET, Severity.CORDON, "GpuRecoveryGpuReset"),
    (2, GpuRecoveryAction.NODE_REBOOT, Severity.DRAIN, "GpuRecoveryNodeReboot"),
    (3, GpuRecoveryAction.DRAIN_P2P, Severity.CORDON, "GpuRecoveryDrainP2p"),
    (4, GpuRecoveryAction.DRAIN_AND_RESET, Severity.DRAIN, "GpuRecoveryDrainAndReset"),
    (5, GpuRecoveryAction.RECOVER_IMEX_DOMAIN, Severity.CORDON, "GpuRecoveryRecoverImexDomain"),
    (6, GpuRecoveryAction.BUS_RESET, Severity.CORDON, "GpuRecoveryBusReset"),
    (7, GpuRecoveryAction.SYSTEM_REBOOT, Severity.DRAIN, "GpuRecoverySystemReboot"),
    (42, GpuRecoveryAction.UNKNOWN, Severity.CORDON, "GpuRecoveryUnknown"),
])
def test_recovery_action_carries_the_drivers_request(value, action, severity, code) -> None:
    states = [(GPUS[6], GpuState("GPU-6", {}, recovery_action=value)), (GPUS[7], GpuState("GPU-7", {}, None, 0))]
    [finding] = GpuStateJudge(ACTIONS, 600).judge(states, 0.0)
    assert (finding.recovery, finding.severity, finding.code, finding.gpu_uuid) == (action, severity, code, "GPU-6")
    assert finding.devices == ("GPU-6",) and finding.key == "nvml:gpu_recovery:GPU-6"


def test_check_actions_override_the_defaults() -> None:
    config = HealthConfig(check_actions=["gpu_recovery_gpu_reset=drain", "nvlink_inactive=degraded"])
    actions = {k: Severity.parse(v) for k, v in config.check_action_map().items()}
    found = GpuStateJudge(actions, 600).judge(
        [*_states(GPU_0={1: False})[:7], (GPUS[7], GpuState("GPU-7", dict.fromkeys(range(18), True), None, 1))], 0.0)
    assert {f.key: f.severity for f in found} == {"nvml:nvlink_inactive:GPU-0": Severity.DEGRADED,
                                                  "nvml:gpu_recovery:GPU-7": Severity.DRAIN}
    with pytest.raises(ValueError, match="CHECK=ACTION"):
        HealthConfig(check_actions=["gpu_recovery_reset=drain"]).check()


# the service, through the simulated twin ---------------------------------------------------------------------------
def _labels(node: SimulatedNode, index: int) -> dict[str, str]:
    gpu = node.topology().gpus[index]
    return {"gpu": str(index), "uuid": gpu.uuid or "", "pci_bus_id": gpu.bus_id}


async def test_nvlink_inactive_makes_that_gpu_unhealthy_and_cordons_until_it_is_back(node, kmsg_file,
                                                                                    start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05))
    get = running.registry.get_sample_value
    labels = _labels(node, 3)
    uuid = labels["uuid"]
    assert running.service.checks["nvlink"] == "ok" and running.service.verdict.verdict == "healthy"
    assert get("gpu_node_agent_nvlink_links_active", labels) == 18
    node.nvml.set_nvlink(uuid, 5, False)
    await until(lambda: running.health().get(uuid) is False)
    verdict = running.service.verdict
    assert verdict.verdict == "cordon" and verdict.reason == "GpuNvlinkInactive" and verdict.devices == (uuid,)
    assert "NVLink 5 inactive" in verdict.message
    assert [uuid] == [d for d, healthy in running.health().items() if not healthy]  # that GPU only
    assert get("gpu_node_agent_nvlink_links_down", labels) == 1
    assert get("gpu_node_agent_nvlink_links_inactive", labels) == 1
    assert get("gpu_node_agent_node_verdict", {"verdict": "cordon"}) == 1
    node.nvml.set_nvlink(uuid, 5, True)
    await until(lambda: running.health().get(uuid) is True)
    assert running.service.verdict.verdict == "healthy"
    assert get("gpu_node_agent_node_verdict", {"verdict": "healthy"}) == 1


async def test_fabric_state_past_the_grace_time_and_back(node, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05,
                                                    gpu_fabric_grace_seconds=0))
    labels = _labels(node, 2)
    uuid = labels["uuid"]
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_gpu_fabric_state", {**labels, "state": "completed"}) == 1
    node.nvml.set_fabric(uuid, FABRIC_IN_PROGRESS)
    await until(lambda: running.service.verdict.reason == "GpuFabricIncomplete")
    assert running.health().get(uuid) is False and running.service.verdict.verdict == "cordon"
    assert get("gpu_node_agent_gpu_fabric_state", {**labels, "state": "in_progress"}) == 1
    node.nvml.set_fabric(uuid, FABRIC_COMPLETED, status=999)  # completed, but the probe failed
    await until(lambda: running.service.verdict.reason == "GpuFabricFailed")
    assert get("gpu_node_agent_gpu_fabric_status", labels) == 999
    node.nvml.set_fabric(uuid, FABRIC_COMPLETED)
    await until(lambda: running.health().get(uuid) is True)
    assert running.service.verdict.verdict == "healthy"
    node.nvml.set_fabric(uuid, FABRIC_NOT_SUPPORTED)  # what NVML says without an NVSwitch fabric: nothing
    await until(lambda: get("gpu_node_agent_gpu_fabric_state", {**labels, "state": "not_supported"}) == 1)
    assert running.service.verdict.verdict == "healthy"


async def test_recovery_action_reaches_the_verdict_for_remediation(node, kmsg_file, start_service) -> None:
    config = fast_config(kmsg_file, gpu_state_interval_seconds=0.05, check_actions=["gpu_recovery_bus_reset=drain"])
    running = await start_service(node, config)
    a, b = _labels(node, 4), _labels(node, 6)
    node.nvml.set_recovery_action(a["uuid"], 1)  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
    await until(lambda: running.service.verdict.verdict == "cordon")
    verdict = running.service.verdict
    assert verdict.recovery == (RecoveryRequest(a["uuid"], GpuRecoveryAction.GPU_RESET),)
    assert verdict.reason == "GpuRecoveryGpuReset" and running.health().get(a["uuid"]) is False
    assert running.service.verdicts.get() == verdict  # what remediation reads
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_gpu_recovery_action", {**a, "action": "gpu_reset"}) == 1
    assert get("gpu_node_agent_gpu_recovery_action", {**a, "action": "none"}) == 0
    node.nvml.set_recovery_action(b["uuid"], 6)  # BUS_RESET, configured to drain
    await until(lambda: running.service.verdict.verdict == "drain")
    assert set(running.service.verdict.recovery) == {RecoveryRequest(a["uuid"], GpuRecoveryAction.GPU_RESET),
                                                     RecoveryRequest(b["uuid"], GpuRecoveryAction.BUS_RESET)}
    node.nvml.reset_gpu(a["uuid"])  # the reset the driver asked for: the field reads NONE again
    node.nvml.reset_gpu(b["uuid"])
    await until(lambda: running.service.verdict.verdict == "healthy")
    assert running.service.verdict.recovery == () and running.health().get(a["uuid"]) is True


async def test_xid_154_reads_the_recovery_action_at_once(node, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=3600))
    uuid = _labels(node, 3)["uuid"]
    passes = running.service.gpu_state.passes
    node.nvml.set_recovery_action(uuid, 4)  # DRAIN_AND_RESET; the next interval is an hour away
    node.nvml.inject_xid(uuid, 154)  # GPU_RECOVERY_ACTION_CHANGED, as the driver reports it with the change
    await until(lambda: running.service.verdict.recovery == (RecoveryRequest(uuid,
                                                                             GpuRecoveryAction.DRAIN_AND_RESET),))
    assert running.service.verdict.verdict == "drain" and running.service.gpu_state.passes == passes + 1


async def test_a_part_that_cannot_be_read_is_never_healthy(node, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05))
    get = running.registry.get_sample_value
    a, b = _labels(node, 0)["uuid"], _labels(node, 1)["uuid"]
    node.nvml.set_recovery_action(b, 2)  # NODE_REBOOT
    await until(lambda: running.service.verdict.verdict == "drain")
    node.nvml.fail_state(b, "recovery_action")  # then the field cannot be read: the request must not vanish
    node.nvml.fail_state(a, "fabric")
    await until(lambda: get("gpu_node_agent_health_check_up", {"check": "gpu_fabric"}) == 0)
    await until(lambda: running.health().get(a) is False)  # unknownHealthAction: unhealthy (the default)
    assert get("gpu_node_agent_health_check_up", {"check": "gpu_recovery_action"}) == 0
    assert get("gpu_node_agent_health_check_up", {"check": "nvlink"}) == 1
    assert running.service.verdict.verdict == "drain"  # the reboot request is kept while unreadable
    assert running.service.verdict.recovery == (RecoveryRequest(b, GpuRecoveryAction.NODE_REBOOT),)
    assert "gpu_fabric unknown" in running.device_health.reason(a)
    node.nvml.fail_state(a, "fabric", "")
    node.nvml.fail_state(b, "recovery_action", "")
    node.nvml.set_recovery_action(b, 0)
    await until(lambda: running.service.verdict.verdict == "healthy")
    assert get("gpu_node_agent_health_check_up", {"check": "gpu_fabric"}) == 1
    assert running.health().get(a) is True and running.health().get(b) is True


async def test_keep_policy_leaves_devices_but_shows_the_check_down(node, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05,
                                                    unknown_health_action="keep"))
    uuid = _labels(node, 5)["uuid"]
    node.nvml.fail_state(uuid, "nvlink")
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_health_check_up",
                                                          {"check": "nvlink"}) == 0)
    assert running.service.checks["nvlink"].startswith("unavailable") and "NVMLError_Unknown" in \
        running.service.checks["nvlink"]
    assert uuid not in running.device_health.unhealthy() and running.service.verdict.verdict == "healthy"


async def test_unsupported_parts_and_lost_gpus(node, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05))
    gpus = [g.uuid or "" for g in node.topology().gpus]
    node.nvml.set_unsupported(gpus[0], "nvlink", "fabric", "recovery_action")
    passes = running.service.gpu_state.passes
    await until(lambda: running.service.gpu_state.passes >= passes + 2)
    assert running.service.checks["nvlink"] == "ok" and running.service.verdict.verdict == "healthy"
    node.nvml.set_recovery_action(gpus[1], 1)
    await until(lambda: running.service.verdict.reason == "GpuRecoveryGpuReset")
    node.nvml.lose_gpu(gpus[1])  # lost: the NVML poll drains; the reset request stays while it cannot be read
    await until(lambda: running.service.verdict.verdict == "drain")
    passes = running.service.gpu_state.passes
    await until(lambda: running.service.gpu_state.passes >= passes + 2)
    assert RecoveryRequest(gpus[1], GpuRecoveryAction.GPU_RESET) in running.service.verdict.recovery


async def test_nvml_unavailable_then_back(node, kmsg_file, start_service) -> None:
    node.nvml.set_available(False)
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05,
                                                    nic_counter_interval_seconds=0.05, nic_hold_seconds=0))
    get = running.registry.get_sample_value
    assert running.service.checks["gpu_fabric"].startswith("unavailable")
    assert get("gpu_node_agent_health_check_up", {"check": "nvlink"}) == 0
    node.nvml.set_available(True)  # the pass keeps looking, so the checks recover with NVML
    await until(lambda: get("gpu_node_agent_health_check_up", {"check": "nvlink"}) == 1)
    await until(lambda: running.service.verdict.verdict == "healthy")


async def test_override_files_inject_faults_from_outside(writable_node, kmsg_file, start_service) -> None:
    node = writable_node
    running = await start_service(node, fast_config(kmsg_file, gpu_state_interval_seconds=0.05))
    uuid = _labels(node, 7)["uuid"]
    override = node.nvml.overrides_dir / f"{uuid}.json"
    override.write_text(json.dumps({"nvlink_inactive": [0], "recovery_action": "drain_and_reset"}))
    await until(lambda: running.service.verdict.verdict == "drain")
    assert running.service.verdict.recovery == (RecoveryRequest(uuid, GpuRecoveryAction.DRAIN_AND_RESET),)
    assert any("NVLink 0 inactive" in r for r in running.service.verdict.reasons)
    override.write_text("{not json")
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_health_check_up",
                                                          {"check": "gpu_fabric"}) == 0)
    override.unlink()
    await until(lambda: running.service.verdict.verdict == "healthy")


def test_profiles_get_their_gpu_models_nvlinks(tmp_path) -> None:
    dgx = build_simulated_node("dgx-h100", tmp_path / "a" / "sys", tmp_path / "a" / "nvml")
    uuid = next(iter(dgx.profile.gpu_uuids.values()))
    state = dgx.nvml.gpu_state(uuid)
    assert len(state.nvlinks) == 18 and all(state.nvlinks.values()) and state.fabric == GpuFabric(FABRIC_COMPLETED)
    assert state.recovery_action == 0 and (tmp_path / "a" / "nvml").is_dir()
    pairs = build_simulated_node("pcie-pairs", tmp_path / "b" / "sys")
    state = pairs.nvml.gpu_state(next(iter(pairs.profile.gpu_uuids.values())))
    assert len(state.nvlinks) == 6 and state.fabric is None and pairs.nvml.overrides_dir is None
    plain = SimulatedNvml(profiles.load_profile("vm-flat").gpu_uuids)  # built without a model: a PCIe board
    assert plain.gpu_state(next(iter(plain.gpu_uuids().values()))).nvlinks == {}
