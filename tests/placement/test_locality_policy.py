"""The preference policy on the Grace and ConnectX-8 layouts (issue 43): with a GPU (whole, MIG device or
time-sliced replica) or a VF already given to the container, the other kind comes from its `gpu_direct_group`;
the score ranks the group (P2C on C2C nodes) above anything merely on the same NUMA node (a BlueField-3).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest

from agent.placement.policy import preferred_gpus_for_vfs, preferred_vfs_for_gpus
from agent.simulate.node import simulated_topology
from agent.topology.model import MigDevice, Topology

PROFILES = ("gb300-cx8", "gb200-cx7", "hgx-b300-cx8", "dgx-h100")
_made: dict[str, Topology] = {}


def topology_of(name: str) -> Topology:
    if name not in _made:
        _made[name] = simulated_topology(name, Path(tempfile.mkdtemp(prefix="gnaloc")) / "sys")
    return _made[name]


def units(topology: Topology) -> list[str]:
    """What the RDMA pool serves: VFs, and RDMA PFs without VFs (the BlueField-3)."""
    return [vf.bus_id for nic in topology.rdma_nics for vf in nic.vfs] + \
        [nic.bus_id for nic in topology.rdma_nics if not nic.vfs]


def group(topology: Topology, device_id: str) -> str:
    gpu = topology.gpu_of(device_id)
    found = gpu if gpu is not None else topology.find(device_id)
    return getattr(found, "gpu_direct_group", "")


@pytest.mark.parametrize("profile", PROFILES)
def test_each_gpu_gets_a_vf_of_its_group_and_each_vf_a_gpu_of_its_group(profile: str) -> None:
    topology = topology_of(profile)
    offered = units(topology)
    for gpu in topology.gpus:
        for name in (gpu.uuid, gpu.bus_id):  # NVIDIA's plugin names GPUs by UUID, others by bus id
            assert name is not None
            [vf] = preferred_vfs_for_gpus(topology, offered, 1, [name])
            assert group(topology, vf) == gpu.gpu_direct_group != "", (profile, name, vf)
    gpus = [g.uuid for g in topology.gpus if g.uuid]
    for vf in offered:
        if not group(topology, vf):
            continue
        [chosen] = preferred_gpus_for_vfs(topology, gpus, 1, [vf])
        assert group(topology, chosen) == group(topology, vf), (profile, vf, chosen)


def test_on_c2c_the_group_beats_a_bluefield_on_the_same_socket() -> None:
    topology = topology_of("gb200-cx7")
    # the BlueField-3 (0001:01:00.0) sorts before the ConnectX-7 VF: only the P2C term can rank the CX7 first
    for gpu in ("0008:01:00.0", "0009:01:00.0"):
        assert preferred_vfs_for_gpus(topology, ["0001:01:00.0", "0002:01:00.1"], 1, [gpu]) == ["0002:01:00.1"]


@pytest.mark.parametrize("profile", ["gb300-cx8", "gb200-cx7"])
def test_mig_devices_and_replicas_sit_where_their_gpu_sits(profile: str) -> None:
    base = topology_of(profile)
    gpus = tuple(dataclasses.replace(g, mig_enabled=True, mig_devices=(
        MigDevice(uuid=f"MIG-{g.index}-0", index=0, gpu_instance=1, compute_instance=0, profile="1g.23gb"),))
        for g in base.gpus)
    topology = dataclasses.replace(base, gpus=gpus)
    offered = units(topology)
    for gpu in topology.gpus:
        for name in (f"MIG-{gpu.index}-0", f"MIG-{gpu.index}-0::1", f"{gpu.uuid}::3"):
            [vf] = preferred_vfs_for_gpus(topology, offered, 1, [name])
            assert group(topology, vf) == gpu.gpu_direct_group, (name, vf)
