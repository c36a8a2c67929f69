"""The health service: replay across restarts, reboots, floods, verdict subscribers, supervision, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from pathlib import Path

from agent.health import kmsg_watch
from agent.signals import HEALTHY
from agent.simulate.node import SimulatedNode
from tests.fakes.clock import FakeClock
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until
from tests.health.conftest import fast_config


def _xid_total(running, gpu, code: int) -> float | None:
    labels = {"gpu": str(gpu.index), "uuid": gpu.uuid, "pci_bus_id": gpu.bus_id, "xid": str(code)}
    return running.registry.get_sample_value("gpu_node_agent_xid_errors_total", labels)


def _skipped(running, reason: str) -> float | None:
    return running.registry.get_sample_value("gpu_node_agent_kmsg_events_skipped_total", {"reason": reason})


async def test_restart_does_not_replay_old_xids(node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    gpus = node.topology().gpus
    kmsg_file.write_text(xid_record(1, "0000:1b:00", 13) + xid_record(2, "0000:43:00", 48))
    first = await start_service(node, fast_config(kmsg_file))
    assert _xid_total(first, gpus[0], 13) == 1 and _xid_total(first, gpus[1], 48) == 1
    assert first.health() == {gpus[1].uuid: False}
    await first.halt()
    saved = json.loads((kmsg_file.parent / "state" / "health-state.json").read_text())
    assert saved["kmsg"]["seq"] == 2 and len(saved["awaiting_reset"]) == 1

    second = await start_service(node, fast_config(kmsg_file))
    assert _xid_total(second, gpus[0], 13) is None  # the old lines were not counted again
    assert _xid_total(second, gpus[1], 48) is None
    assert second.health() == {gpus[1].uuid: False}  # the fault still waits for a reset
    assert second.service.verdict.verdict == "isolate"
    with kmsg_file.open("a") as log:
        log.write(xid_record(3, "0000:1b:00", 13))
    await until(lambda: _xid_total(second, gpus[0], 13) == 1)


async def test_reboot_starts_fresh(node: SimulatedNode, kmsg_file: Path, boot_id_file: Path,
                                   start_service) -> None:
    gpus = node.topology().gpus
    kmsg_file.write_text(xid_record(1, "0000:43:00", 48))
    first = await start_service(node, fast_config(kmsg_file))
    assert first.service.verdict.verdict == "isolate"
    await first.halt()
    boot_id_file.write_text("99999999-2222-3333-4444-555555555555\n")
    kmsg_file.write_text(xid_record(1, "0000:1b:00", 13))  # the new boot's kernel log
    second = await start_service(node, fast_config(kmsg_file))
    assert second.service.verdict.verdict == "healthy" and second.health() == {}
    assert _xid_total(second, gpus[0], 13) == 1


async def test_a_flood_is_counted_and_acted_on_once(node: SimulatedNode, kmsg_file: Path, start_service,
                                                    caplog) -> None:
    gpu = node.topology().gpus[6]
    running = await start_service(node, fast_config(kmsg_file))
    verdicts = running.service.verdicts
    assert verdicts.get() == HEALTHY
    published = verdicts.version
    caplog.set_level(logging.INFO, logger="agent.health")
    with kmsg_file.open("a") as log:
        log.writelines(xid_record(10 + i, "0000:d1:00", 45, "pid=7, name=python3, Ch 00000001 caused by previous "
                                  "Xid 149") for i in range(500))
        log.writelines(xid_record(600 + i, "0000:d1:00", 119, "Timeout after 6s waiting for RPC") for i in range(50))
    await until(lambda: _xid_total(running, gpu, 119) == 50)
    assert _xid_total(running, gpu, 45) == 500
    assert [e.healthy for e in running.drain()] == [False]  # one device event
    latest = verdicts.get()
    assert verdicts.version == published + 1 and latest is not None and latest.verdict == "drain"  # one verdict
    logged = [r.getMessage() for r in caplog.records if "from kmsg" in r.getMessage()]
    assert len(logged) == 2 and "Xid 45 (PREEMPTIVE_REMOVAL" in logged[0] and "counted only" in logged[0]


async def test_other_line_forms_reach_the_right_gpu(node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    gpus = node.topology().gpus
    running = await start_service(node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        log.write("6,1,1,-;NVRM: Xid (PCI:0000:c3:00 GPU-I:05): 95, pid=7194, Uncontained: FBHUB. RST: Yes\n")
        log.write("3,2,2,-;NVRM: The NVIDIA GPU 0000:df:00.0 (PCI ID: 10de:2330) installed in this system has "
                  "fallen off the bus and is not responding to commands.\n")
        log.write("3,3,3,-;NVRM: Xid (0000:9d:00): 13, Graphics Exception\n")
        log.write("3,4,4,-;NVRM: Xid (PCI:0000:ee:00): 79, GPU has fallen off the bus.\n")  # not one of ours
        log.write("3,5,5,-;NVRM: Xid (GPU 7): 62, pid=1, PMU halt\n")  # no address at all: not one of ours either
    await until(lambda: running.health().get(gpus[7].uuid) is False)
    await until(lambda: running.health().get(gpus[5].uuid) is False)
    assert _xid_total(running, gpus[4], 13) == 1 and gpus[4].uuid not in running.health()
    # a device that is not an address of this node is a logged skip, never a finding (issue 14)
    await until(lambda: _skipped(running, "foreign_device") == 2)
    stranger = {"gpu": "", "uuid": "", "pci_bus_id": "0000:ee:00.0", "xid": "79"}
    assert running.registry.get_sample_value("gpu_node_agent_xid_errors_total", stranger) is None
    assert running.service.verdict.verdict == "drain"
    assert running.registry.get_sample_value("gpu_node_agent_node_verdict", {"verdict": "drain"}) == 1
    assert running.registry.get_sample_value("gpu_node_agent_node_verdict", {"verdict": "healthy"}) == 0


async def test_remediation_reset_and_verdict_readers(node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    gpu = node.topology().gpus[0]
    running = await start_service(node, fast_config(kmsg_file))
    heard: list[str] = []

    async def read_verdicts() -> None:  # what remediation does: wait for a newer value, act on the latest
        seen = running.service.verdicts.version
        while True:
            seen, verdict = await running.service.verdicts.wait_newer(seen)
            heard.append(verdict.verdict)

    reader = asyncio.create_task(read_verdicts())
    try:
        node.nvml.inject_xid(gpu.uuid, 62)
        await until(lambda: heard == ["drain"])
        running.service.gpu_reset_done(gpu.uuid)
        assert running.service.verdicts.get() == HEALTHY  # published at once, not at the reader's pace
        await until(lambda: heard == ["drain", "healthy"])
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
    await until(lambda: running.health() == {gpu.uuid: True})


class _Broken:
    """A link port that fails: the supervisor restarts it and the other producers carry on."""

    calls = 0

    def netdev_states(self) -> dict:
        _Broken.calls += 1
        raise OSError("netlink socket refused")

    def rdma_port_states(self, rdma: str) -> dict:
        return {}

    def subscribe(self) -> None:
        raise OSError("netlink socket refused")


async def test_a_failing_producer_is_restarted_and_the_rest_runs(node: SimulatedNode, kmsg_file: Path,
                                                                 start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file), link_port=_Broken())
    assert running.service.checks["links"].startswith("failed: OSError")
    assert running.registry.get_sample_value("gpu_node_agent_health_check_up", {"check": "links"}) == 0
    await until(lambda: _Broken.calls >= 3)  # retried with backoff
    gpu = node.topology().gpus[0]
    with kmsg_file.open("a") as log:
        log.write(xid_record(1, "0000:1b:00", 79))
    await until(lambda: running.health().get(gpu.uuid) is False)


async def test_a_missing_kmsg_file_is_waited_for(node: SimulatedNode, tmp_path: Path, start_service,
                                                 monkeypatch) -> None:
    monkeypatch.setattr(kmsg_watch, "MISSING_FILE_RETRY_SECONDS", 0.02)
    path = tmp_path / "later-kmsg"
    running = await start_service(node, fast_config(path))
    assert running.service.checks["kmsg"].startswith("unavailable: no such file")
    assert running.service.checks["nvml_poll"] == "ok"
    path.write_text(xid_record(1, "0000:1b:00", 79))
    await until(lambda: running.health().get(node.topology().gpus[0].uuid) is False)
    assert running.service.checks["kmsg"] == "ok"


async def test_an_unreadable_kmsg_is_a_failed_check_not_a_crash(node: SimulatedNode, tmp_path: Path,
                                                                start_service) -> None:
    running = await start_service(node, fast_config(tmp_path))  # a directory: open() fails
    assert running.service.checks["kmsg"].startswith("failed: IsADirectoryError")
    assert running.service.checks["nvml_poll"] == "ok"


async def test_stop_leaves_no_tasks_or_threads(node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    before = asyncio.all_tasks()
    running = await start_service(node, fast_config(kmsg_file))
    assert any(t.name.startswith("nvml-events") for t in threading.enumerate())
    await running.halt()
    assert asyncio.all_tasks() - before == set()
    await until(lambda: not any(t.name.startswith("nvml-events") for t in threading.enumerate()))


async def test_kmsg_can_be_off(node: SimulatedNode, start_service) -> None:
    running = await start_service(node, fast_config(""))
    assert running.service.checks["kmsg"] == "off"


async def test_a_character_device_is_followed_by_readiness(node: SimulatedNode, start_service,
                                                           monkeypatch) -> None:
    """/dev/kmsg is pollable; a pty is a character device that also hands out one line per read."""
    monkeypatch.setattr(kmsg_watch, "DEVICE_WAKE_SECONDS", 60.0)  # so only readiness can wake the reader
    master, slave = os.openpty()
    try:
        running = await start_service(node, fast_config(os.ttyname(slave)), kmsg_file_poll_interval=60.0)
        assert running.service.checks["kmsg"] == "ok"
        gpu = node.topology().gpus[3]
        os.write(master, xid_record(7, "0000:61:00", 74).encode())
        await until(lambda: running.health().get(gpu.uuid) is False)
        await running.halt()
    finally:
        os.close(master)
        os.close(slave)


async def test_degraded_findings_expire_after_the_hold(node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    clock = FakeClock(1000.0)
    running = await start_service(node, fast_config(kmsg_file, degraded_hold_seconds=60), clock=clock)
    uuid = node.topology().gpus[0].uuid
    await until(lambda: running.service.nvml_poll.polls >= 1)
    node.nvml.inject_ecc(uuid, corrected=1)
    await until(lambda: running.service.verdict.verdict == "degraded")
    polls = running.service.nvml_poll.polls
    await until(lambda: running.service.nvml_poll.polls >= polls + 2)  # the poll saw the growth too
    await clock.advance(59)
    await until(lambda: running.service.nvml_poll.polls >= polls + 4)
    assert running.service.verdict.verdict == "degraded"
    await clock.advance(2)
    await until(lambda: running.service.verdict.verdict == "healthy")


# A GB200-style NVLink5 burst as NVIDIA's driver writes it: every NVRM line with KERN_CONT, so /dev/kmsg flags each
# record `c` (the record form of NVIDIA/DCGM dcgmlib/src/tests/DcgmKmsgReaderTests.cpp). Message texts are verbatim
# from public sources; only the bus addresses are swapped for four GPUs of the simulated dgx-h100:
#   Xid 149 / 145: leptonai/gpud#1174 ("kmsg input" lines);
#   Xid 154: NVIDIA/open-gpu-kernel-modules#1134 ("Xid 154 (Node Reboot Required)"), text form as in gpu-health.md;
#   Xid 45 cascades: NVIDIA/open-gpu-kernel-modules#1150 (four GPUs, "caused by previous Xid 149/145");
#   Xid 13 storm: leptonai/gpud components/accelerator/nvidia/error/xid/README.md (three lines in one second).
_BURST = [
    "NVRM: Xid (PCI:{a}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 0x00000000 "
    "0x00000000 0x00000000)",
    "NVRM: Xid (PCI:{b}): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 "
    "0x00000000 0x00000000)",
    "NVRM: Xid (PCI:{a}): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    "NVRM: Xid (PCI:{b}): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
    "NVRM: Xid (PCI:{a}): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
    "NVRM: Xid (PCI:{c}): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145",
    "NVRM: Xid (PCI:{d}): 45, pid=1818989, name=python3, Ch 00000002 caused by previous Xid 145",
    "NVRM: Xid (PCI:{a}): 45, pid=1818990, name=python3, Ch 00000002 caused by previous Xid 149",
    "NVRM: Xid (PCI:{c}): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): "
    "Illegal Instruction Parameter",
    "NVRM: Xid (PCI:{c}): 13, pid='<unknown>', name=<unknown>, Graphics SM Global Exception on (GPC 7, TPC 7, SM 0): "
    "Multiple Warp Errors",
    "NVRM: Xid (PCI:{c}): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x57c730=0xc04000b "
    "0x57c734=0x24 0x57c728=0x1f81fb60 0x57c72c=0x1174",
]


async def test_a_real_driver_burst_counts_every_xid_on_every_gpu(node: SimulatedNode, kmsg_file: Path,
                                                                   start_service) -> None:
    gpus = node.topology().gpus
    a, b, c, d = gpus[0], gpus[1], gpus[2], gpus[3]
    keys = {"a": a.bus_id[:-2], "b": b.bus_id[:-2], "c": c.bus_id[:-2], "d": d.bus_id[:-2]}
    running = await start_service(node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        for seq, text in enumerate(_BURST, start=100):
            log.write(f"4,{seq},{437812449 + seq},c;{text.format(**keys)}\n")
    await until(lambda: _xid_total(running, c, 13) == 3)
    assert _xid_total(running, a, 149) == 1 and _xid_total(running, b, 149) == 1  # the second GPU is not lost
    assert _xid_total(running, a, 154) == 1 and _xid_total(running, b, 154) == 1
    assert _xid_total(running, a, 45) == 2 and _xid_total(running, c, 45) == 1 and _xid_total(running, d, 45) == 1
    assert running.health() == {a.uuid: False, b.uuid: False}  # both fatal NVLink5 GPUs; cascades act on nothing
    assert running.service.verdict.verdict == "drain"


async def test_user_space_writes_and_dmesg_multiline_bus_loss(node: SimulatedNode, kmsg_file: Path,
                                                            start_service) -> None:
    gpus = node.topology().gpus
    running = await start_service(node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        # facility LOG_USER: `echo ... > /dev/kmsg` from a container (NVSentinel's fault injector does exactly this)
        log.write(f"12,1,1,-;NVRM: Xid (PCI:{gpus[0].bus_id[:-2]}): 79, GPU has fallen off the bus.\n")
        # NVIDIA/NVSentinel#155: the dmesg form of the multi-line bus-loss message (no Xid line at all)
        log.write(f"[ 1843.308145] NVRM: The NVIDIA GPU {gpus[6].bus_id}\n"
                  "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
                  "               NVRM: fallen off the bus and is not responding to commands.\n"
                  "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n")
    await until(lambda: running.health().get(gpus[6].uuid) is False)
    await until(lambda: _skipped(running, "not_kernel") == 1)
    assert gpus[0].uuid not in running.health()


async def test_a_deeply_nested_state_file_is_ignored_not_a_crash_loop(node: SimulatedNode, kmsg_file: Path,
                                                                     start_service) -> None:
    state = kmsg_file.parent / "state"
    state.mkdir(exist_ok=True)
    (state / "health-state.json").write_text("[" * 100_000 + "]" * 100_000)
    kmsg_file.write_text(xid_record(1, "0000:1b:00", 13))
    running = await start_service(node, fast_config(kmsg_file))
    assert _xid_total(running, node.topology().gpus[0], 13) == 1 and running.service.checks["kmsg"] == "ok"
