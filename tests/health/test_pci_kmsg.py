"""mlx5, AER and SXid kernel-log lines: real lines from public sources, mapped to the devices under the bus id.

The samples are the message part of kernel records (what /dev/kmsg carries after `prio,seq,usec,-;`), with
the `kernel: [   17.98] ` prefix of the syslog/dmesg copies they come from removed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.health.pci_kmsg import parse_pci_fault
from agent.simulate.node import SimulatedNode
from tests.fakes.polling import until
from tests.health.conftest import fast_config

# NVIDIA/NVSentinel, syslog-health-monitor end-to-end test (SysLogsNICDriverError, fatal and non-fatal NIC
# driver patterns injected as syslog lines).
MLX5_CMD_TIMEOUT = ("mlx5_core 0000:03:00.0: wait_func:964:(pid 112): ENABLE_HCA(0x104) timeout. Will cause a leak "
                    "of a command resource")
MLX5_MISS_COUNT = "mlx5_core 0000:41:00.0: poll_health:852:(pid 0): device's health compromised - reached miss count"
MLX5_UNRECOVERABLE = ("mlx5_core 0000:41:00.0: print_health_info:458:(pid 0): synd 0x8: unrecoverable hardware "
                      "error")
MLX5_SLOT_POWER = ("mlx5_core 0000:01:00.0: mlx5_pcie_event:326:(pid 165): Detected insufficient power on the PCIe "
                   "slot (27W).")
MLX5_MODULE_TEMP = "mlx5_core 0000:5c:00.0: Port module event[error]: module 0, Cable error, High Temperature"
MLX5_ACCESS_REG = ("mlx5_core 0000:d2:00.0: mlx5_cmd_out_err:838:(pid 1441871): ACCESS_REG(0x805) op_mod(0x1) failed, "
                   "status bad operation(0x2), syndrome (0x305684), err(-22)")
# linux-pci mailing list, "PCI/ERR: ... status" thread (Zhiqiang Hou, 2020): the e1000e fatal error log.
AER_ROOT_PORT = "pcieport 0002:00:00.0: AER: Uncorrected (Fatal) error received: 0002:01:00.0"
AER_DEVICE = ("e1000e 0002:01:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Inaccessible, "
              "(Unregistered Agent ID)")
# linux-pci list, "PCI/AER: Extend AER error handling to RCECs" cover letter (Qiuxu Zhuo), aer_inject log.
AER_RCEC = "pcieport 0000:ed:00.4: AER: Uncorrected (Fatal) error received: 0000:ed:01.0"
# Linux drivers/pci/pcie/aer.c since the Dec 2023 rewording (lore 20231206224231.732765-3), as quoted in
# node-health-checks.md §4.2.
AER_NEW_CORRECTABLE = "pcieport 0000:00:1d.0: AER: Correctable error message received from 0000:02:00.0"
# leptonai/gpud components/accelerator/nvidia/sxid README (dmesg of a GPU falling off the bus).
SXID_FATAL = "nvidia-nvswitch1: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up"
SXID_SEVERITY_LINE = ("nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Severity 1 Engine instance 60 Sub-engine "
                      "instance 00")


@pytest.mark.parametrize(("line", "kind", "bus_id"), [
    (MLX5_CMD_TIMEOUT, "nic_driver_fatal", "0000:03:00.0"),
    (MLX5_MISS_COUNT, "nic_driver_fatal", "0000:41:00.0"),
    (MLX5_UNRECOVERABLE, "nic_driver_fatal", "0000:41:00.0"),
    (MLX5_SLOT_POWER, "nic_driver_warning", "0000:01:00.0"),
    (MLX5_MODULE_TEMP, "nic_driver_warning", "0000:5c:00.0"),
    (AER_ROOT_PORT, "pcie_aer_fatal", "0002:01:00.0"),  # the reporting endpoint, not the root port
    (AER_DEVICE, "pcie_aer_fatal", "0002:01:00.0"),
    (AER_RCEC, "pcie_aer_fatal", "0000:ed:01.0"),
    (AER_ROOT_PORT.replace("Uncorrected (Fatal)", "Uncorrected (Non-Fatal)"), "pcie_aer_nonfatal", "0002:01:00.0"),
    (SXID_FATAL, "nvswitch_fatal", "0000:06:00.0"),
])
def test_real_lines_parse_to_the_device(line: str, kind: str, bus_id: str) -> None:
    fault = parse_pci_fault(line)
    assert fault is not None and (fault.kind, fault.bus_id) == (kind, bus_id)


@pytest.mark.parametrize("line", [MLX5_ACCESS_REG, AER_NEW_CORRECTABLE, SXID_SEVERITY_LINE, "mlx5_core garbage",
                                  "NVRM: Xid (PCI:0000:1b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
                                  "off the bus.", "pcieport zz:00.0: AER: Uncorrected (Fatal) error received: nope"])
def test_noise_and_correctable_lines_are_not_faults(line: str) -> None:
    assert parse_pci_fault(line) is None


def _record(seq: int, message: str) -> str:
    return f"3,{seq},{1000 + seq},-;{message}\n"


async def test_kernel_faults_mark_the_devices_under_that_bus_id_and_foreign_ones_change_nothing(
        writable_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    node = writable_node
    running = await start_service(node, fast_config(kmsg_file, nic_counter_interval_seconds=0.05,
                                                    nic_hold_seconds=0.5))
    topology = node.topology()
    nic, gpu = topology.rdma_nics[4], topology.gpus[6]
    with kmsg_file.open("a") as log:  # the same real lines, for devices not on this node
        log.write(_record(1, MLX5_MISS_COUNT))
        log.write(_record(2, AER_ROOT_PORT))
        log.write(_record(3, SXID_FATAL))
    await until(lambda: running.service.nic.kernel_faults_foreign == 3)
    assert running.service.verdict.verdict == "healthy" and not running.health()
    with kmsg_file.open("a") as log:  # now naming this node's NIC and GPU
        log.write(_record(4, MLX5_MISS_COUNT.replace("0000:41:00.0", nic.bus_id)))
        log.write(_record(5, AER_DEVICE.replace("e1000e 0002:01:00.0", f"nvidia {gpu.bus_id}")))
    vfs = {vf.bus_id for vf in nic.vfs}
    await until(lambda: all(running.health().get(vf) is False for vf in vfs))
    await until(lambda: running.health().get(gpu.uuid) is False)
    unhealthy = {d for d, ok in running.health().items() if not ok}
    assert unhealthy == {nic.bus_id, *vfs, gpu.uuid}  # that PF's VFs and that GPU only
    assert running.service.verdict.verdict == "cordon"
    await until(lambda: all(running.health().get(d) is True for d in unhealthy), "healthy after the hold")


