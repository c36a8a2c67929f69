"""Assemble the node model from its sources: sysfs for devices, NVML for GPU UUIDs, NCCL XML for positions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agent.nvml import Nvml
from agent.topology import nccl_xml
from agent.topology.model import Topology
from agent.topology.routes import default_route_interfaces
from agent.topology.sysfs import SysfsReader


def load_topology(sysfs_root: Path | str, nvml: Nvml, topology_file: Path | str | None = None,
                  proc_root: Path | str = Path("/proc")) -> Topology:
    """Read sysfs, name GPUs by NVML UUID, then take positions from the NCCL XML when one is given.

    Raises `nccl_xml.TopologyXmlError` for a malformed XML; sysfs problems are logged and skipped.
    """
    topology = SysfsReader(sysfs_root).read(nvml.gpu_uuids())
    topology = dataclasses.replace(topology, default_route_netdevs=default_route_interfaces(proc_root))
    if topology_file:
        topology = nccl_xml.apply_xml(topology, nccl_xml.parse_nccl_xml(Path(topology_file)))
    return topology
