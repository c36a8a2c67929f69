"""NIC counters, PCIe links and AER judged from real kernel files on a simulated sysfs tree.

Rules with time in them (an hour of symbol errors, five flaps in a minute, a 40 s outage) are checked on the
judge with explicit times, reading the files the test rewrites; device health, the verdict, metrics, the hold
time and restarts are checked through a running HealthService.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.health.nic_counters import CounterJudge, Thresholds
from agent.host.nic_sysfs import NicSysfs, parse_aer
from agent.simulate.node import SimulatedNode
from agent.topology.model import Nic
from tests.fakes.clock import FakeClock
from tests.fakes.polling import until
from tests.health.conftest import fast_config
from tests.health.test_pci_kmsg import MLX5_MISS_COUNT

# A real aer_dev_fatal file (Linux drivers/pci/pcie/aer.c aer_stats_attrs output, as shown in
# Documentation/ABI/testing/sysfs-bus-pci-devices-aer_stats): one line per bit, then the TOTAL.
AER_FATAL_SAMPLE = """Undefined 0
DLP 0
SDES 0
TLP 0
FCP 0
CmpltTO 0
CmpltAbrt 0
UnxCmplt 0
RxOF 0
MalfTLP 0
ECRC 0
UnsupReq 0
ACSViol 0
UncorrIntErr 0
BlockedTLP 0
AtomicOpBlocked 0
TLPBlockedErr 0
PoisonTLPBlocked 0
TOTAL_ERR_FATAL 0
"""


def _port_dir(root: Path, rdma: str) -> Path:
    return root / "class" / "infiniband" / rdma / "ports" / "1"


def _bump(root: Path, rdma: str, counter: str, by: int = 1, sub: str = "counters") -> None:
    path = _port_dir(root, rdma) / sub / counter
    path.write_text(f"{int(path.read_text()) + by}\n")


def _set_state(root: Path, rdma: str, up: bool) -> None:
    (_port_dir(root, rdma) / "state").write_text("4: ACTIVE\n" if up else "1: DOWN\n")
    (_port_dir(root, rdma) / "phys_state").write_text("5: LinkUp\n" if up else "2: Polling\n")


def _aer_fatal(root: Path, bus_id: str, total: int) -> None:
    text = AER_FATAL_SAMPLE.replace("TOTAL_ERR_FATAL 0", f"TOTAL_ERR_FATAL {total}").replace("DLP 0", f"DLP {total}")
    (root / "bus" / "pci" / "devices" / bus_id / "aer_dev_fatal").write_text(text)


@pytest.fixture
def tree(tmp_path: Path, dgx_root: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(dgx_root, root, symlinks=True)
    return root


def _judge_pass(judge: CounterJudge, sysfs: NicSysfs, now: float, nics: list[str] | None = None,
                functions: list[str] = ()) -> set[tuple[str, str]]:  # type: ignore[assignment]
    reading = sysfs.read_pass(nics or ["mlx5_0", "mlx5_1"], functions)
    return {(o.check, o.subject) for o in judge.judge(reading, now)}


def test_aer_total_is_parsed_from_the_kernel_format() -> None:
    assert parse_aer(AER_FATAL_SAMPLE, "fatal") == 0
    assert parse_aer(AER_FATAL_SAMPLE.replace("TOTAL_ERR_FATAL 0", "TOTAL_ERR_FATAL 3"), "fatal") == 3
    assert parse_aer("RxErr 1\n", "correctable") is None


def test_history_before_the_agent_is_not_a_fault_and_increases_are(tree: Path) -> None:
    _bump(tree, "mlx5_0", "link_downed", 7)  # before the first read: history
    judge, sysfs = CounterJudge(Thresholds()), NicSysfs(tree)
    assert _judge_pass(judge, sysfs, 0.0) == set()
    _bump(tree, "mlx5_0", "link_downed")
    assert _judge_pass(judge, sysfs, 10.0) == {("nic_link_downed", "mlx5_0/1")}
    assert _judge_pass(judge, sysfs, 20.0) == set()  # no further increase
    (_port_dir(tree, "mlx5_0") / "counters" / "link_downed").write_text("0\n")  # cleared: a reset, new baseline
    assert _judge_pass(judge, sysfs, 30.0) == set()
    _bump(tree, "mlx5_1", "excessive_buffer_overrun_errors")
    assert _judge_pass(judge, sysfs, 40.0) == {("nic_link_errors", "mlx5_1/1")}


def test_symbol_error_storm_is_judged_by_hourly_rate(tree: Path) -> None:
    judge, sysfs = CounterJudge(Thresholds(symbol_errors_per_hour=120)), NicSysfs(tree)
    _judge_pass(judge, sysfs, 0.0)
    _bump(tree, "mlx5_0", "symbol_error", 100)
    assert _judge_pass(judge, sysfs, 600.0) == set()  # 100 in the hour: under the rate
    _bump(tree, "mlx5_0", "symbol_error", 30)
    assert _judge_pass(judge, sysfs, 1200.0) == {("nic_symbol_errors", "mlx5_0/1")}  # 130 within the hour
    assert _judge_pass(judge, sysfs, 4300.0) == set()  # the first 100 left the window


def test_five_flaps_in_a_minute_and_a_receive_error_storm(tree: Path) -> None:
    judge, sysfs = CounterJudge(Thresholds(flaps_per_minute=5, rcv_errors_per_second=10)), NicSysfs(tree)
    _judge_pass(judge, sysfs, 0.0)
    for second in (10.0, 20.0, 30.0, 40.0):
        _bump(tree, "mlx5_0", "link_error_recovery")
        assert ("nic_link_flapping", "mlx5_0/1") not in _judge_pass(judge, sysfs, second)
    _bump(tree, "mlx5_0", "link_error_recovery")
    assert ("nic_link_flapping", "mlx5_0/1") in _judge_pass(judge, sysfs, 50.0)
    _bump(tree, "mlx5_1", "port_rcv_errors", 500)
    assert ("nic_rcv_errors", "mlx5_1/1") in _judge_pass(judge, sysfs, 60.0)  # 50/s over 10 s


def test_an_outage_of_40_seconds_is_a_finding_and_counts_as_a_flap(tree: Path) -> None:
    judge, sysfs = CounterJudge(Thresholds(outage_seconds=30)), NicSysfs(tree)
    _judge_pass(judge, sysfs, 0.0)
    _set_state(tree, "mlx5_0", up=False)
    assert _judge_pass(judge, sysfs, 10.0) == set()
    assert _judge_pass(judge, sysfs, 50.0) == {("nic_link_outage", "mlx5_0/1")}  # down 40 s
    _set_state(tree, "mlx5_0", up=True)
    assert _judge_pass(judge, sysfs, 60.0) == {("nic_link_outage", "mlx5_0/1")}  # came back after 50 s
    assert judge.flap_totals == {"mlx5_0/1": 1} and judge.last_flaps[0].downtime == 50.0
    _set_state(tree, "mlx5_1", up=False)
    _judge_pass(judge, sysfs, 70.0)
    _set_state(tree, "mlx5_1", up=True)
    assert _judge_pass(judge, sysfs, 75.0) == set()  # a 5 s blip: counted, not an outage
    assert judge.flap_totals["mlx5_1/1"] == 1


def test_downtrained_link_aer_and_a_slower_port(tree: Path, node: SimulatedNode) -> None:
    topology = node.topology()
    gpu = topology.gpus[0]
    judge, sysfs = CounterJudge(Thresholds()), NicSysfs(tree)
    assert _judge_pass(judge, sysfs, 0.0, functions=[gpu.bus_id]) == set()
    assert sysfs.upstream_ports(gpu.bus_id)  # the switch ports above it are read too
    (tree / "bus" / "pci" / "devices" / gpu.bus_id / "current_link_width").write_text("8\n")
    (tree / "bus" / "pci" / "devices" / gpu.bus_id / "current_link_speed").write_text("2.5 GT/s PCIe\n")
    _aer_fatal(tree, gpu.bus_id, 1)
    (_port_dir(tree, "mlx5_1") / "rate").write_text("200 Gb/sec (4X HDR)\n")
    assert _judge_pass(judge, sysfs, 10.0, functions=[gpu.bus_id]) == {
        ("pcie_downtrained", gpu.bus_id), ("pcie_aer_fatal", gpu.bus_id), ("nic_low_rate", "mlx5_1/1")}


def test_unreadable_counters_are_reported_missing(tree: Path) -> None:
    shutil.rmtree(_port_dir(tree, "mlx5_1") / "counters")
    shutil.rmtree(_port_dir(tree, "mlx5_1") / "hw_counters")
    (_port_dir(tree, "mlx5_1") / "state").unlink()
    reading = NicSysfs(tree).read_pass(["mlx5_0", "mlx5_1", "mlx5_99"], [])
    assert set(reading.missing) == {"mlx5_1/1", "mlx5_99"}
    assert [p.device for p in reading.ports] == ["mlx5_0"]


# --- through the service -------------------------------------------------------------------------------------

def _nic_config(kmsg: Path, **changes: object) -> object:
    values = {"nic_counter_interval_seconds": 0.05, "nic_hold_seconds": 0.3, **changes}
    return fast_config(kmsg, **values)


def _vfs(nic: Nic) -> set[str]:
    return {vf.bus_id for vf in nic.vfs}


async def test_link_downed_marks_only_that_pfs_vfs_unhealthy_and_back_after_the_hold(
        writable_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    node = writable_node
    running = await start_service(node, _nic_config(kmsg_file))
    nic, other = node.topology().rdma_nics[2], node.topology().rdma_nics[3]
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_health_check_up", {"check": "nic_counters"}) == 1
    _bump(node.sysfs_root, nic.rdma or "", "link_downed")
    await until(lambda: all(running.health().get(vf) is False for vf in _vfs(nic)))
    assert not _vfs(other) & {d for d, ok in running.health().items() if not ok}
    assert running.service.verdict.verdict == "degraded" and running.service.verdict.reason == "NicLinkDowned"
    assert get("gpu_node_agent_nic_port_events_total",
               {"device": nic.rdma, "port": "1", "counter": "link_downed"}) == 1
    await until(lambda: all(running.health().get(vf) is True for vf in _vfs(nic)), "healthy after the hold")
    assert running.service.verdict.verdict == "healthy"


async def test_gpu_link_x8_aer_fatal_and_a_removed_gpu(writable_node: SimulatedNode, kmsg_file: Path,
                                                       start_service) -> None:
    node = writable_node
    running = await start_service(node, _nic_config(kmsg_file))
    gpus = node.topology().gpus
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_gpus_expected") == 8 and get("gpu_node_agent_gpus_present") == 8
    width = node.sysfs_root / "bus" / "pci" / "devices" / gpus[1].bus_id / "current_link_width"
    width.write_text("8\n")
    await until(lambda: running.health().get(gpus[1].uuid) is False)
    assert get("gpu_node_agent_pcie_link_degraded", {"device": gpus[1].bus_id}) == 1
    assert {d for d, ok in running.health().items() if not ok} == {gpus[1].uuid}  # that GPU only
    width.write_text("16\n")
    await until(lambda: running.health().get(gpus[1].uuid) is True)
    _aer_fatal(node.sysfs_root, gpus[2].bus_id, 1)
    await until(lambda: running.service.verdict.verdict == "cordon")
    assert running.service.verdict.reason == "PcieAerFatal" and running.health()[gpus[2].uuid] is False
    gpu_dir = (node.sysfs_root / "bus" / "pci" / "devices" / gpus[5].bus_id).resolve()
    shutil.rmtree(gpu_dir)
    await until(lambda: get("gpu_node_agent_gpus_present") == 7)
    await until(lambda: running.health().get(gpus[5].uuid) is False)
    assert any("missing from the PCI bus" in r for r in running.service.verdict.reasons)


async def test_a_restart_judges_missed_increases_once_and_a_reboot_is_a_baseline(
        writable_node: SimulatedNode, kmsg_file: Path, boot_id_file: Path, tmp_path: Path, start_service) -> None:
    node, state = writable_node, tmp_path / "state"
    nic = node.topology().rdma_nics[0]
    first = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=600), state_dir=state)
    await first.halt()
    _bump(node.sysfs_root, nic.rdma or "", "link_downed")  # while the agent was down
    second = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=600), state_dir=state)
    assert second.health().get(nic.vfs[0].bus_id) is False
    await second.halt()
    third = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=600), state_dir=state)
    assert third.service.verdict.verdict == "healthy"  # the same increase is not raised again
    await third.halt()
    _bump(node.sysfs_root, nic.rdma or "", "link_downed")
    boot_id_file.write_text("99999999-2222-3333-4444-555555555555\n")  # a reboot: the first read is the baseline
    fourth = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=600), state_dir=state)
    assert fourth.service.verdict.verdict == "healthy"


async def test_unreadable_counters_make_that_nic_unhealthy_until_they_read_again(
        writable_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    node = writable_node
    running = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=0))
    nic = node.topology().rdma_nics[1]
    state = _port_dir(node.sysfs_root, nic.rdma or "") / "state"
    state.unlink()  # a removed file (sysfs: a removed device answers ENODEV) even to a reader that kept it open
    get = running.registry.get_sample_value
    await until(lambda: get("gpu_node_agent_health_check_up", {"check": "nic_counters"}) == 0)
    await until(lambda: all(running.health().get(vf) is False for vf in _vfs(nic)))
    state.write_text("4: ACTIVE\n")
    await until(lambda: get("gpu_node_agent_health_check_up", {"check": "nic_counters"}) == 1)
    await until(lambda: all(running.health().get(vf) is True for vf in _vfs(nic)))


async def test_nvml_init_failure_on_a_gpu_node_marks_the_gpus_unhealthy_and_recovers(
        writable_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    node = writable_node
    running = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=0))
    uuids = {g.uuid for g in node.topology().gpus}
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_health_check_up", {"check": "nvml"}) == 1
    node.nvml.set_available(False)  # type: ignore[attr-defined]
    await until(lambda: all(running.health().get(u) is False for u in uuids))
    assert get("gpu_node_agent_health_check_up", {"check": "nvml"}) == 0
    assert running.service.verdict.reason == "GpuHealthUnknown"
    node.nvml.set_available(True)  # type: ignore[attr-defined]
    await until(lambda: all(running.health().get(u) is True for u in uuids))
    assert get("gpu_node_agent_health_check_up", {"check": "nvml"}) == 1
    assert running.service.verdict.verdict == "healthy"


async def test_unknown_health_action_keep_leaves_devices_alone(writable_node: SimulatedNode, kmsg_file: Path,
                                                              start_service) -> None:
    node = writable_node
    node.nvml.set_available(False)  # type: ignore[attr-defined]
    running = await start_service(node, _nic_config(kmsg_file, unknown_health_action="keep"))
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_health_check_up", {"check": "nvml"}) == 0
    assert running.service.verdict.verdict == "healthy" and not running.health()


async def test_gpudirect_rdma_module_missing_is_a_degraded_finding(writable_node: SimulatedNode, kmsg_file: Path,
                                                                   start_service) -> None:
    node = writable_node
    module = node.sysfs_root / "module" / "nvidia_peermem"
    assert module.is_dir()  # the simulated GPU node loads it
    running = await start_service(node, _nic_config(kmsg_file, nic_hold_seconds=0))
    assert running.service.verdict.verdict == "healthy"
    shutil.rmtree(module)
    await until(lambda: running.service.verdict.reason == "GpuDirectRdmaMissing")
    assert running.service.verdict.verdict == "degraded" and "nvidia_peermem" in running.service.verdict.message
    (node.sysfs_root / "module" / "gdrdrv").mkdir()  # GDRCopy's module is enough
    await until(lambda: running.service.verdict.verdict == "healthy")


def test_open_files_are_reread_and_notice_removal(tmp_path: Path) -> None:
    from agent.host.nic_sysfs import OpenFiles

    path = tmp_path / "link_downed"
    path.write_text("1\n")
    files = OpenFiles(limit=4)
    assert files.read(str(path)) == "1\n" and len(files) == 1
    path.write_text("2\n")  # rewritten in place: the kept file reads the new text
    assert files.read(str(path)) == "2\n"
    path.unlink()
    assert files.read(str(path)) is None and len(files) == 0
    path.write_text("3\n")
    assert files.read(str(path)) == "3\n"
    full = OpenFiles(limit=0)  # no budget: open, read, close
    assert full.read(str(path)) == "3\n" and len(full) == 0
    files.close()
    assert len(files) == 0


async def test_a_held_finding_clears_when_its_hold_ends_not_at_the_next_pass(
        writable_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    """Passes every 10 s, hold 25 s: a link_downed seen at 10 s is last seen then, held until 35 s; the pass
    loop wakes at 35 s (not 40 s) and the finding clears right then. Fake time moves only here."""
    node, clock = writable_node, FakeClock()
    t0 = clock.monotonic()
    running = await start_service(node, _nic_config(kmsg_file, nic_counter_interval_seconds=10, nic_hold_seconds=25,
                                                    link_check_interval_seconds=0), clock=clock)
    nic = node.topology().rdma_nics[2]

    async def asleep_until(at: float) -> None:  # the pass finished and the loop sleeps until `at`
        await until(lambda: clock.next_deadline() == at, f"the NIC pass loop waiting for t0+{at - t0:g}")

    await asleep_until(t0 + 10)
    _bump(node.sysfs_root, nic.rdma or "", "link_downed")
    await clock.advance(10)
    await until(lambda: all(running.health().get(vf) is False for vf in _vfs(nic)), "VFs Unhealthy")
    await asleep_until(t0 + 20)  # still seen at 10 s: no wake-up for its hold yet
    await clock.advance(10)
    await asleep_until(t0 + 30)  # the 20 s pass no longer sees it: held until 35 s, after the next pass
    await clock.advance(10)
    await asleep_until(t0 + 35)  # the 30 s pass: the hold ends before the 40 s pass, so wake then
    assert all(running.health().get(vf) is False for vf in _vfs(nic))
    await clock.advance(5)
    await until(lambda: all(running.health().get(vf) is True for vf in _vfs(nic)), "healthy at the hold's end")
    assert clock.monotonic() == t0 + 35
    assert running.service.verdict.verdict == "healthy"
    await asleep_until(t0 + 45)  # and back to the interval


async def test_a_kernel_fault_held_shorter_than_the_interval_clears_at_its_hold_end(
        node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    """A fault from the kernel log arrives between passes; its hold (3 s) ends long before the next pass (60 s)."""
    clock = FakeClock()
    t0 = clock.monotonic()
    running = await start_service(node, _nic_config(kmsg_file, nic_counter_interval_seconds=60, nic_hold_seconds=3,
                                                    link_check_interval_seconds=0), clock=clock)
    await until(lambda: clock.next_deadline() == t0 + 60, "the NIC pass loop asleep")
    nic = node.topology().rdma_nics[1]
    with kmsg_file.open("a") as log:  # a real line (see test_pci_kmsg.py for its source), naming this node's NIC
        log.write(f"3,1,1001,-;{MLX5_MISS_COUNT.replace('0000:41:00.0', nic.bus_id)}\n")
    await until(lambda: all(running.health().get(vf) is False for vf in _vfs(nic)), "VFs Unhealthy")
    await until(lambda: clock.next_deadline() == t0 + 3, "woken to wait for the hold's end")
    await clock.advance(3)
    await until(lambda: all(running.health().get(vf) is True for vf in _vfs(nic)), "healthy at the hold's end")
    assert clock.monotonic() == t0 + 3
