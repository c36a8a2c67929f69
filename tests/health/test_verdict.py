"""The verdict book: worst finding wins, devices follow findings, each kind of finding ends by its own rule."""

from __future__ import annotations

from pathlib import Path

from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.findings import Clears, Finding, GpuRef
from agent.health.verdict import VerdictBook
from agent.host.nvml import MemoryHealth, NvmlEvent, SimulatedNvml
from agent.signals import HEALTHY, DeviceHealth, NodeVerdict, Severity
from agent.simulate import profiles
from agent.topology.load import load_topology


def _reset(key: str, severity: Severity = Severity.DRAIN, gpu: str = "GPU-a") -> Finding:
    return Finding(key, severity, f"{key} happened", Clears.RESET, (gpu,), gpu, code="GpuXid79", hardware=True)


def test_empty_book_is_healthy() -> None:
    assert VerdictBook().verdict() == HEALTHY


def test_worst_severity_wins_and_reasons_are_most_severe_first() -> None:
    book = VerdictBook()
    book.add(Finding("sbe", Severity.DEGRADED, "ECC growing", Clears.HOLD, expires_at=10, code="GpuEccSbe",
                     hardware=True))
    book.add(Finding("remap", Severity.CORDON, "remap pending", Clears.STATE, ("GPU-b",), code="GpuRowRemapPending"))
    assert book.verdict() == NodeVerdict(Severity.CORDON, "GpuRowRemapPending", "remap pending; ECC growing",
                                         ("GPU-b",), hardware=False, reasons=("remap pending", "ECC growing"))
    book.add(_reset("xid79"))
    verdict = book.verdict()
    assert (verdict.verdict, verdict.reason, verdict.devices, verdict.hardware) == ("drain", "GpuXid79", ("GPU-a",),
                                                                                    True)
    assert verdict.message == "xid79 happened; remap pending; ECC growing"
    assert book.unhealthy_devices() == {"GPU-a": "xid79 happened", "GPU-b": "remap pending"}


def test_count_only_findings_do_not_change_the_verdict() -> None:
    book = VerdictBook([Finding("link", Severity.HEALTHY, "link down", Clears.STATE, ("0000:18:00.1",))])
    assert book.verdict() == HEALTHY
    assert book.unhealthy_devices() == {"0000:18:00.1": "link down"}


def test_repeats_change_nothing_but_extend_holds() -> None:
    book = VerdictBook()
    assert book.add(_reset("xid79"))
    assert not book.add(_reset("xid79"))
    assert not book.add(_reset("xid79", Severity.DEGRADED))  # a milder repeat never softens a reset fault
    hold = Finding("sbe", Severity.DEGRADED, "ECC growing", Clears.HOLD, expires_at=10)
    assert book.add(hold)
    assert not book.add(Finding("sbe", Severity.DEGRADED, "ECC growing", Clears.HOLD, expires_at=20))
    assert book.expire(now=15) == []
    assert [f.key for f in book.expire(now=20)] == ["sbe"]


def test_reset_findings_end_only_with_their_gpus_reset() -> None:
    book = VerdictBook([_reset("xid79:a", gpu="GPU-a"), _reset("xid48:b", gpu="GPU-b"),
                        Finding("remap:a", Severity.CORDON, "remap", Clears.STATE, ("GPU-a",))])
    assert book.expire(now=1e9) == []
    assert [f.key for f in book.gpu_reset("GPU-a")] == ["xid79:a"]
    assert set(book.unhealthy_devices()) == {"GPU-a", "GPU-b"}  # the STATE finding is the poller's to end
    assert [f.key for f in book.awaiting_reset()] == ["xid48:b"]
    assert book.remove("remap:a") is not None
    assert set(book.unhealthy_devices()) == {"GPU-b"}


def test_gpu_ref_labels() -> None:
    assert GpuRef("3", "GPU-x", "0000:9d:00.0").name == "GPU 3 (0000:9d:00.0)"


def test_every_code_the_assessor_uses_is_a_valid_verdict_reason(dgx_root: Path) -> None:
    """Health publishes `agent.signals.NodeVerdict`s: every code the assessor uses must be a valid reason there."""
    topology = load_topology(dgx_root, SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids).gpu_uuids())
    assessor = HealthAssessor(HealthConfig(), topology, DeviceHealth(), clock=lambda: 0.0)
    a, b, c = (gpu.uuid or "" for gpu in topology.gpus[:3])
    assessor.on_xid(assessor.names.by_uuid(a), 79, "kmsg")
    assessor.on_xid(assessor.names.by_uuid(b), 119, "kmsg")
    assessor.on_xid(assessor.names.by_uuid(b), 999, "kmsg")
    assessor.on_gpu_lost(assessor.names.by_uuid(c), "NVML: GPU is lost", from_nvml=True)
    assessor.on_nvml_event(NvmlEvent("sbe", a))
    assessor.on_nvml_event(NvmlEvent("dbe", a))
    assessor.on_memory(MemoryHealth(b, remap_pending=True, remap_failure=True, retired_pages_pending=True))
    assessor.on_link(topology.rdma_nics[0], False, "ibp24s0 no carrier")
    codes = {f.code for f in assessor.book.findings()}
    assert codes == {"GpuXid79", "GpuXid119", "GpuXid999", "GpuLost", "GpuEccSbe", "GpuEccDbe", "GpuRowRemapPending",
                     "GpuRowRemapFailure", "GpuPageRetirementPending", "NicLinkDown"}
    for finding in assessor.book.findings():
        NodeVerdict(Severity.DRAIN, finding.code, finding.reason, finding.devices, finding.hardware)
    assert assessor.verdict.severity is Severity.DRAIN
    assert assessor.verdict == assessor.book.verdict()  # the book's verdict is the published type itself
    assert assessor.verdict.verdict == "drain" and assessor.verdict.hardware
    assert set(assessor.verdict.devices) == {a, b, c}  # the drain-level findings' devices


def _isolate(key: str, gpu: str, devices: tuple[str, ...] | None = None) -> Finding:
    return Finding(key, Severity.ISOLATE, f"{key} on {gpu}", Clears.RESET, (gpu,) if devices is None else devices,
                   gpu, code="GpuXid48", hardware=True)


def test_isolate_holds_for_one_device_and_a_second_one_drains_the_node() -> None:
    book = VerdictBook([_isolate("xid:48:a", "GPU-a"), _isolate("xid:64:a", "GPU-a")])
    book.add(Finding("sbe", Severity.DEGRADED, "ECC growing on b", Clears.HOLD, ("GPU-b",), expires_at=10,
                     code="GpuEccSbe"))
    verdict = book.verdict()
    assert verdict.severity is Severity.ISOLATE and verdict.devices == ("GPU-a",) and verdict.reason == "GpuXid48"
    book.add(_isolate("xid:48:b", "GPU-b"))
    verdict = book.verdict()
    assert verdict.severity is Severity.DRAIN and verdict.reason == "MultipleDevicesIsolated"
    assert set(verdict.devices) == {"GPU-a", "GPU-b"}
    book.remove("xid:48:b")
    assert book.verdict().severity is Severity.ISOLATE


def test_a_nic_isolates_with_its_vfs_and_a_finding_without_a_device_cannot_be_contained() -> None:
    nic = Finding("link:pf", Severity.ISOLATE, "ibp24s0 down", Clears.STATE, ("0000:18:00.0", "0000:18:00.2",
                                                                             "0000:18:00.3"), code="NicLinkDown")
    verdict = VerdictBook([nic]).verdict()
    assert verdict.severity is Severity.ISOLATE and verdict.devices == nic.devices
    nowhere = Finding("gpudirect", Severity.ISOLATE, "nvidia_peermem missing", Clears.STATE, code="GpuDirectMissing")
    assert VerdictBook([nowhere]).verdict().severity is Severity.DRAIN


def test_a_gpu_off_the_bus_asks_for_a_reboot_and_a_reset_class_xid_for_a_reset(dgx_root: Path) -> None:
    from agent.signals import GpuRecoveryAction, RecoveryRequest
    topology = load_topology(dgx_root, SimulatedNvml(profiles.load_profile("dgx-h100").gpu_uuids).gpu_uuids())
    assessor = HealthAssessor(HealthConfig(), topology, DeviceHealth(), clock=lambda: 0.0)
    a, b = (gpu.uuid or "" for gpu in topology.gpus[:2])
    assessor.on_xid(assessor.names.by_uuid(a), 79, "kmsg")  # RESTART_BM
    assessor.on_xid(assessor.names.by_uuid(b), 119, "kmsg")  # RESET_GPU
    assert set(assessor.verdict.recovery) == {RecoveryRequest(a, GpuRecoveryAction.NODE_REBOOT),
                                              RecoveryRequest(b, GpuRecoveryAction.GPU_RESET)}
