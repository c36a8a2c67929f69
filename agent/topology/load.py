"""Assemble the node model from its sources: sysfs for devices, GPU UUIDs (NVML's), NCCL XML for positions.

The UUIDs come in as a plain map, so the model never imports the NVML port (`agent.host`) that reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path

from agent.topology import nccl_xml
from agent.topology.model import Topology
from agent.topology.routes import default_route_interfaces
from agent.topology.sysfs import SysfsReader


def load_topology(sysfs_root: Path | str, gpu_uuids: Mapping[str, str], topology_file: Path | str | None = None,
                  proc_root: Path | str = Path("/proc"), *, gpu_minors: Mapping[str, int] | None = None,
                  mig_gpus: Collection[str] = ()) -> Topology:
    """Read sysfs, name GPUs by UUID, then take positions from the NCCL XML when one is given.

    `gpu_uuids`: canonical bus id -> UUID, as `Nvml.gpu_uuids()` answers.

    Raises `nccl_xml.TopologyXmlError` for a malformed XML; sysfs problems are logged and skipped.
    """
    topology = SysfsReader(sysfs_root).read(gpu_uuids)
    minors = gpu_minors or {}
    topology = dataclasses.replace(topology, gpus=tuple(
        dataclasses.replace(gpu, minor=minors.get(gpu.bus_id), mig_enabled=gpu.bus_id in mig_gpus)
        for gpu in topology.gpus))
    topology = dataclasses.replace(topology, default_route_netdevs=default_route_interfaces(proc_root))
    if topology_file:
        topology = nccl_xml.apply_xml(topology, nccl_xml.parse_nccl_xml(Path(topology_file)))
    return topology
