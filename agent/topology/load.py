"""Assemble the node model from its sources: sysfs for devices, GPU UUIDs (NVML's), NCCL XML for positions.

The UUIDs come in as a plain map, so the model never imports the NVML port (`agent.host`) that reads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from agent.topology import locality, nccl_xml
from agent.topology.model import Gpu, MigDevice, Topology
from agent.topology.routes import default_route_interfaces
from agent.topology.sysfs import SysfsReader


class MigReading(Protocol):
    """One MIG device as an NVML port reads it (the port's own type; the model never imports the port)."""

    @property
    def uuid(self) -> str: ...
    @property
    def gpu_instance(self) -> int: ...
    @property
    def compute_instance(self) -> int: ...
    @property
    def profile(self) -> str: ...
    @property
    def gpu_slices(self) -> int: ...
    @property
    def compute_slices(self) -> int: ...


def with_nvml(gpu: Gpu, minors: Mapping[str, int], mig_gpus: Collection[str],
              mig_devices: Mapping[str, Sequence[MigReading]]) -> Gpu:
    """The GPU with what NVML says of it: its minor, MIG mode and MIG devices."""
    mig = gpu.bus_id in mig_gpus
    devices = tuple(MigDevice(uuid=r.uuid, index=i, gpu_instance=r.gpu_instance,
                              compute_instance=r.compute_instance, profile=r.profile, gpu_slices=r.gpu_slices,
                              compute_slices=r.compute_slices)
                    for i, r in enumerate(mig_devices.get(gpu.bus_id, ()))) if mig else ()
    return dataclasses.replace(gpu, minor=minors.get(gpu.bus_id), mig_enabled=mig, mig_devices=devices)


def load_topology(sysfs_root: Path | str, gpu_uuids: Mapping[str, str], topology_file: Path | str | None = None,
                  proc_root: Path | str = Path("/proc"), *, gpu_minors: Mapping[str, int] | None = None,
                  mig_gpus: Collection[str] = (),
                  mig_devices: Mapping[str, Sequence[MigReading]] | None = None,
                  data_direct_vfs: bool = True) -> Topology:
    """Read sysfs, name GPUs by UUID, then take positions from the NCCL XML when one is given.

    `gpu_uuids`: canonical bus id -> UUID, as `Nvml.gpu_uuids()` answers; `mig_devices`: canonical bus id -> the
    MIG devices of that GPU, as `Nvml.mig_devices()` answers (kept for GPUs in `mig_gpus` only);
    `data_direct_vfs`: `topology.dataDirectVfs` (a Data Direct PF's VFs placed at its DMA function).

    Raises `nccl_xml.TopologyXmlError` for a malformed XML; sysfs problems are logged and skipped.
    """
    topology = SysfsReader(sysfs_root, data_direct_vfs=data_direct_vfs).read(gpu_uuids)
    minors = gpu_minors or {}
    topology = dataclasses.replace(topology, gpus=tuple(
        with_nvml(gpu, minors, mig_gpus, mig_devices or {}) for gpu in topology.gpus))
    topology = dataclasses.replace(topology, default_route_netdevs=default_route_interfaces(proc_root))
    if topology_file:
        topology = nccl_xml.apply_xml(topology, nccl_xml.parse_nccl_xml(Path(topology_file)))
        topology = locality.annotate(topology)  # the XML's positions decide the groups
    return topology
