"""Health behind every MIG device (issue 30): an Xid naming a GPU instance (`GPU-I:<n>`) takes out that MIG
device when its code is the instance's; a GPU-wide fault takes out the parent and all its slices. Through the
kernel-log reader and the health service on the simulated profile dgx-h100-mig (GPUs 0-3: seven 1g.10gb MIG
devices each, GPU instances 1-7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.simulate.node import SimulatedNode, build_simulated_node
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until
from tests.health.conftest import fast_config


@pytest.fixture(scope="module")
def mig_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mig") / "sys"
    build_simulated_node("dgx-h100-mig", root)
    return root


@pytest.fixture
def mig_node(mig_root: Path) -> SimulatedNode:
    from agent.simulate import profiles
    from agent.simulate.node import simulated_nvml

    profile = profiles.load_profile("dgx-h100-mig")
    return SimulatedNode(profile=profile, sysfs_root=mig_root, nvml=simulated_nvml(profile))


def _line(seq: int, bus: str, instance: int, code: int) -> str:
    return f"6,{seq},{seq},-;NVRM: Xid (PCI:{bus} GPU-I:{instance:02d}): {code}, pid=7194, name=python3, " \
           "Contained: CE User Channel (0x9). RST: No\n"


async def test_an_instance_xid_takes_out_exactly_that_mig_device(mig_node: SimulatedNode, kmsg_file: Path,
                                                                 start_service) -> None:
    """Xid 94 (CONTAINED_ERROR, RESTART_APP) is counted only by default, per NVIDIA's catalog; with
    `--xid-action 94=isolate` a line naming GPU-I 3 of GPU 1 makes that one MIG device Unhealthy."""
    gpu = mig_node.topology().gpus[1]
    target = gpu.mig_device(3)
    assert target is not None
    running = await start_service(mig_node, fast_config(kmsg_file, xid_actions=["94=isolate"]))
    with kmsg_file.open("a") as log:
        log.write(_line(1, "0000:43:00", 3, 94))
    await until(lambda: running.health() != {})
    assert running.health() == {target.uuid: False}
    assert "GPU-I 3" in running.device_health.reason(target.uuid)


async def test_xid_94_is_counted_only_by_default(mig_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    gpu = mig_node.topology().gpus[1]
    running = await start_service(mig_node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        log.write(_line(1, "0000:43:00", 3, 94))
    labels = {"gpu": "1", "uuid": gpu.uuid, "pci_bus_id": gpu.bus_id, "xid": "94"}
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_xid_errors_total", labels) == 1)
    assert running.health() == {}


async def test_a_gpu_wide_code_on_an_instance_line_takes_the_parent_and_its_slices(
        mig_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    """Xid 95 (UNCONTAINED_ERROR, RESET_GPU) needs the GPU reset: the parent and all seven slices go."""
    gpu = mig_node.topology().gpus[2]
    running = await start_service(mig_node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        log.write(_line(1, "0000:52:00", 4, 95))
    await until(lambda: len(running.health()) == 8)
    assert running.health() == {gpu.uuid: False} | {m.uuid: False for m in gpu.mig_devices}


async def test_xid_79_withdraws_all_seven_slices(mig_node: SimulatedNode, kmsg_file: Path, start_service) -> None:
    gpu = mig_node.topology().gpus[1]
    running = await start_service(mig_node, fast_config(kmsg_file))
    with kmsg_file.open("a") as log:
        log.write(xid_record(1, "0000:43:00", 79, "GPU has fallen off the bus."))
    await until(lambda: len(running.health()) == 8)
    assert running.health() == {gpu.uuid: False} | {m.uuid: False for m in gpu.mig_devices}
    assert all(not running.device_health.is_healthy(m.uuid) for m in gpu.mig_devices)
