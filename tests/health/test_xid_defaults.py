"""Issue 26: Xid defaults as NVIDIA's catalog says, through the kernel log of a running health service.

Xid 63 (row-remap event, bucket IGNORE) and 94 (contained ECC error, RESTART_APP) leave every GPU Healthy and are
counted; 63 advises a reset (`gpu_node_agent_gpu_reset_pending`) that the next observed reset ends. Xid 48, 64 and
95 isolate their GPU. The Xid 63 and 94 texts are real driver lines (NVIDIA's Xid catalog, "Xid 63: Row Remapper",
and the MIG `GPU-I` form from NVIDIA's XID errors documentation), the same ones `test_nvrm` parses.
"""

from __future__ import annotations

import pytest

from agent.simulate.node import SimulatedNode
from tests.fakes.polling import until
from tests.health.conftest import fast_config

XID_63 = "pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate."
XID_94 = "pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No"


def _record(seq: int, bus: str, code: int, text: str, gpu_instance: int | None = None) -> str:
    where = bus.rsplit(".", 1)[0] + (f" GPU-I:{gpu_instance:02d}" if gpu_instance is not None else "")
    return f"3,{seq},{1000 + seq},-;NVRM: Xid (PCI:{where}): {code}, {text}\n"


async def test_xid_63_and_94_are_counted_and_leave_every_gpu_healthy(node: SimulatedNode, kmsg_file,
                                                                     start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file))
    gpus = node.topology().gpus
    lines = [_record(1, gpus[0].bus_id, 63, XID_63), _record(2, gpus[1].bus_id, 94, XID_94),
             _record(3, gpus[2].bus_id, 94, XID_94, gpu_instance=5), _record(4, gpus[3].bus_id, 63, XID_63, 3)]
    with kmsg_file.open("a") as log:
        log.writelines(lines)

    def count(index: int, code: int) -> float | None:
        gpu = gpus[index]
        return running.registry.get_sample_value("gpu_node_agent_xid_errors_total", {
            "gpu": str(index), "uuid": gpu.uuid or "", "pci_bus_id": gpu.bus_id, "xid": str(code)})

    await until(lambda: [count(0, 63), count(1, 94), count(2, 94), count(3, 63)] == [1, 1, 1, 1],
                "all four Xids counted")
    assert all(healthy for healthy in running.health().values())
    assert running.service.verdict.verdict == "healthy"

    def pending(index: int) -> float | None:
        gpu = gpus[index]
        return running.registry.get_sample_value("gpu_node_agent_gpu_reset_pending", {
            "gpu": str(index), "uuid": gpu.uuid or "", "pci_bus_id": gpu.bus_id})

    assert [pending(i) for i in range(4)] == [1, 0, 0, 1]  # a remap waits for a reset; a contained error does not
    assert running.service.verdict.reset_advised == tuple(sorted([gpus[0].uuid or "", gpus[3].uuid or ""]))
    running.service.gpu_reset_done(gpus[0].uuid or "")  # what remediation reports after resetting it
    await until(lambda: pending(0) == 0, "the reset applies the remap: the advisory ends")


@pytest.mark.parametrize("code", [48, 64, 95])
async def test_xids_that_need_a_reset_isolate_their_gpu(node: SimulatedNode, kmsg_file, start_service,
                                                        code: int) -> None:
    running = await start_service(node, fast_config(kmsg_file))
    gpu = node.topology().gpus[5]
    with kmsg_file.open("a") as log:
        log.write(_record(1, gpu.bus_id, code, "pid=1, name=python3, test"))
    await until(lambda: running.health().get(gpu.uuid or "") is False, f"Xid {code} withdraws GPU 5")
    assert running.service.verdict.verdict == "isolate"
