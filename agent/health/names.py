"""GPU names for health: each source names a GPU its own way (UUID, kernel-log `0000:1b:00`), labels want all.

NVML and DCGM name GPUs by UUID, the kernel log by bus address without function; `GpuNames` turns either into
a `GpuRef` (index, UUID, canonical bus id) from the current topology, and remembers UUIDs the driver's
`NVRM: GPU at PCI:...: GPU-...` lines taught it for GPUs the topology could not name.
"""

from __future__ import annotations

from agent.health.findings import GpuRef
from agent.host.busid import bus_key
from agent.topology.model import Topology


class GpuNames:
    """The topology's GPUs by every name a health source uses."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._learned_uuids: dict[str, str] = {}  # kernel device key -> UUID from NVRM map lines

    def update(self, topology: Topology) -> None:
        """Name GPUs from a rescanned topology from now on."""
        self.topology = topology

    def uuids(self) -> tuple[str, ...]:
        """UUIDs of the GPUs in the topology (what NVML is asked about)."""
        return tuple(g.uuid for g in self.topology.gpus if g.uuid)

    def by_uuid(self, uuid: str) -> GpuRef:
        """Labels of a GPU known by UUID."""
        gpu = self.topology.gpu_by_uuid(uuid)
        return GpuRef(str(gpu.index), uuid, gpu.bus_id) if gpu else GpuRef(uuid=uuid)

    def by_kernel_device(self, device: str, parsed: bool = True) -> GpuRef:
        """Labels of a GPU named the kernel-log way (`0000:1b:00`); the raw text when it is not one of ours."""
        if not parsed:
            return GpuRef(bus_id=device)
        gpu = next((g for g in self.topology.gpus if bus_key(g.bus_id) == device), None)
        if gpu is None:
            return GpuRef(uuid=self._learned_uuids.get(device, ""), bus_id=f"{device}.0")
        return GpuRef(str(gpu.index), gpu.uuid or self._learned_uuids.get(device, ""), gpu.bus_id)

    def is_local_kernel_device(self, device: str) -> bool:
        """Whether a kernel-log device (`0000:1b:00`) is a GPU of this node (topology, or an NVRM map line)."""
        return device in self._learned_uuids or any(bus_key(g.bus_id) == device for g in self.topology.gpus)

    def learn_uuid(self, device: str, uuid: str) -> None:
        """An `NVRM: GPU at PCI:...: GPU-...` line named a GPU's UUID."""
        self._learned_uuids[device] = uuid
