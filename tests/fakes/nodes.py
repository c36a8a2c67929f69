"""Synthetic GPU nodes built straight from the topology model, for the allocation tests and benchmark.

No sysfs round trip (that is `agent.simulate`'s job): these are exact, tiny and fast to build, so property
tests can make thousands of them. Bus ids follow the tree (depth first), so GPU index order is bus order as
on a real host. Shared by `tests/placement` and `bench/allocation_latency.py` (which puts the repository
root on sys.path); no pytest here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.topology.model import Gpu, Location, Nic, PciInfo, Topology, Vf


@dataclass(frozen=True, order=True)
class Slot:
    """Where one device sits: socket (= NUMA node), root complex in it, top switch, lower switch.

    `top` None: straight on a root port. `lower` None: directly under the top switch.
    """

    socket: int
    root: int
    top: int | None = None
    lower: int | None = None

    def location(self, numa_known: bool = True, c2c: bool = False) -> Location:
        """The model's location for this slot; `c2c`: below a Grace/Vera root port."""
        root = f"pci0000:{0x40 * self.socket + 0x10 * self.root:02x}"
        switches: tuple[str, ...] = ()
        if self.top is not None:
            switches = (f"{root}/top{self.top}",)
            if self.lower is not None:
                switches += (f"{root}/top{self.top}/low{self.lower}",)
        return Location(root=root, switches=switches, numa=self.socket if numa_known else None, c2c=c2c)


def _key(slot: Slot) -> tuple:
    return (slot.socket, slot.root, -1 if slot.top is None else slot.top,
            -1 if slot.lower is None else slot.lower)


def build_node(gpus: Sequence[Slot], nics: Sequence[tuple[Slot, int]], numa_known: bool = True,
               c2c_sockets: frozenset[int] = frozenset()) -> Topology:
    """A node with GPUs at `gpus` and RDMA NIC PFs at `nics` (slot, VF count; 0 = the PF is the device);
    the sockets in `c2c_sockets` are Grace/Vera ones (their devices P2C apart)."""
    placed = sorted([(_key(slot), 0, slot, 0) for slot in gpus] + [(_key(s), 1, s, n) for s, n in nics],
                    key=lambda item: (item[0], item[1]))
    gpu_list: list[Gpu] = []
    nic_list: list[Nic] = []
    for bus, (_, is_nic, slot, vf_count) in enumerate(placed, start=1):
        bus_id = f"0000:{bus:02x}:00.0"
        location = slot.location(numa_known, slot.socket in c2c_sockets)
        if not is_nic:
            gpu_list.append(Gpu(index=len(gpu_list), pci=PciInfo(bus_id=bus_id, vendor="0x10de"),
                                location=location, uuid=f"GPU-{bus:02x}000000-sim"))
            continue
        vfs = tuple(
            Vf(pci=PciInfo(bus_id=f"0000:{bus:02x}:{(i + 1) // 8:02x}.{(i + 1) % 8}", vendor="0x15b3"),
               pf_bus_id=bus_id, vf_index=i, rdma=f"mlx5_{bus}v{i}")
            for i in range(vf_count))
        nic_list.append(Nic(pci=PciInfo(bus_id=bus_id, vendor="0x15b3"), location=location,
                            rdma=f"mlx5_{bus}", link_type="infiniband", sriov_totalvfs=vf_count, vfs=vfs))
    return Topology(gpus=tuple(gpu_list), nics=tuple(nic_list), source="synthetic")


def dgx_h100_like() -> Topology:
    """2 sockets x 2 root complexes x (top switch -> 2 lower switches, each 1 GPU + 1 IB NIC with 8 VFs)."""
    slots = [Slot(s, r, 0, low) for s in range(2) for r in range(2) for low in range(2)]
    return build_node(slots, [(slot, 8) for slot in slots])


def pcie_pairs_like() -> Topology:
    """2 sockets x 2 switches (one root complex per socket), each switch 2 GPUs + 1 NIC with 4 VFs."""
    switches = [Slot(s, 0, top) for s in range(2) for top in range(2)]
    return build_node([slot for slot in switches for _ in range(2)], [(slot, 4) for slot in switches])


def gpu_ids(topology: Topology) -> list[str]:
    """The IDs the GPU resource advertises: UUIDs."""
    return [gpu.uuid or gpu.bus_id for gpu in topology.gpus]


def nic_ids(topology: Topology) -> list[str]:
    """The IDs the NIC resource advertises: VF bus ids, or the PF's for a PF without VFs."""
    return [vf.bus_id for nic in topology.rdma_nics for vf in nic.vfs] + [
        nic.bus_id for nic in topology.rdma_nics if not nic.vfs]
