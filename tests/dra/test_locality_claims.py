"""DRA on every GPU-NIC layout (issue 43): the GPUDirect attributes, and the shipped claim template that pairs a GPU
with a NIC of its group through one `matchAttribute`, allocated claim after claim until the node is full.

Slices go through the real lightkube port to the HTTP API double; the allocator is `tests.fakes.dra_allocator`.
"""

from __future__ import annotations

import pytest

from agent.dra.devices import node_devices
from agent.dra.pool import device_entries
from agent.dra.slices import SlicePublisher
from agent.kube.cluster import LightkubeCluster
from agent.topology.model import Level, Topology
from tests.dra.conftest import DRIVER, RDMA_RESOURCE, claim_template, device_classes, profile_topology
from tests.fakes.apiserver import ApiServerDouble
from tests.fakes.dra_allocator import allocate

GROUP = "gpunodeagent.io/gpuDirectGroup"
PATH = "gpunodeagent.io/gpuDirectPath"
DMA = "gpunodeagent.io/dataDirectFunction"
NUMA = "resource.kubernetes.io/numaNode"
BUS = "resource.kubernetes.io/pciBusID"
ROOT = "resource.kubernetes.io/pcieRoot"
# profile -> (path of every GPU, how many GPU+VF claims fit: one per GPU, every GPU has a NIC of its group)
SHAPES = {"gb300-cx8": ("data-direct", 4), "gb200-cx7": ("c2c", 4), "hgx-b300-cx8": ("pcie-switch", 8),
          "dgx-h100": ("pcie-switch", 8)}


@pytest.mark.parametrize("profile", sorted(SHAPES))
def test_gpus_and_vfs_carry_path_group_and_numa(profile: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    topology = profile_topology(profile, tmp_path_factory)
    devices = node_devices(topology, RDMA_RESOURCE)
    path, _ = SHAPES[profile]
    for device in devices:
        attrs = device.attributes
        assert set(attrs[NUMA]) == {"int"}
        if device.kind == "gpu":
            assert attrs[PATH] == {"string": path} and GROUP in attrs
        elif device.function is not None and device.pf is not None:
            assert attrs.get(GROUP, {}).get("string", "") == device.function.gpu_direct_group  # none: no group
            assert (DMA in attrs) == (path == "data-direct")
            assert attrs[ROOT]["string"] == device.pf.location.root  # its own root, not the DMA function's
    if profile == "gb300-cx8":
        vf = next(d for d in devices if d.bus_id == "0000:03:00.1")
        assert vf.attributes[DMA] == {"string": "0009:03:00.0"}
        assert vf.attributes[GROUP] == {"string": "sw:0009:01:00.0"}
        assert vf.attributes["gpunodeagent.io/pcieSwitchGroup"] == {"string": "0009:01:00.0"}


@pytest.mark.parametrize("profile", sorted(SHAPES))
async def test_one_match_attribute_on_the_group_pairs_every_gpu_with_its_nic(
        api: ApiServerDouble, port: LightkubeCluster, profile: str,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    topology: Topology = profile_topology(profile, tmp_path_factory)
    await SlicePublisher(port, DRIVER).publish(device_entries(node_devices(topology, RDMA_RESOURCE), {}))
    slices = list(api.resource_slices.values())
    by_name = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    in_use: set[tuple[str, str, str]] = set()
    claims = 0
    while (allocation := allocate(claim_template("gpu-nic-same-group"), device_classes(), slices, in_use)):
        results = {r["request"]: r for r in allocation["devices"]["results"]}
        gpu, vf = (by_name[results[k]["device"]]["attributes"] for k in ("gpu", "vf"))
        assert gpu[GROUP] == vf[GROUP]
        assert topology.level(gpu[BUS]["string"], vf[BUS]["string"]) in (Level.PIX, Level.PXB, Level.P2C)
        in_use |= {(r["driver"], r["pool"], r["device"]) for r in results.values()}
        claims += 1
    assert claims == SHAPES[profile][1]


def test_mig_devices_carry_their_gpus_group(tmp_path_factory: pytest.TempPathFactory) -> None:
    import dataclasses

    from agent.topology.model import MigDevice
    base = profile_topology("gb300-cx8", tmp_path_factory)
    gpu = dataclasses.replace(base.gpus[0], mig_enabled=True, mig_devices=(
        MigDevice(uuid="MIG-a", index=0, gpu_instance=1, compute_instance=0, profile="1g.23gb"),))
    devices = node_devices(dataclasses.replace(base, gpus=(gpu, *base.gpus[1:])), RDMA_RESOURCE)
    mig = next(d for d in devices if d.kind == "mig")
    assert mig.attributes[GROUP] == {"string": gpu.gpu_direct_group}
    assert mig.attributes[PATH] == {"string": "data-direct"}
    assert any(d.kind == "rdma" and d.attributes.get(GROUP) == mig.attributes[GROUP] for d in devices)
