"""The node's hardware model: GPUs, RDMA NICs (physical functions with their VFs) and where they sit in PCIe.

Every subsystem reads this one value. Sources (sysfs, NCCL topology XML, NVML) build it; nothing mutates it:
a rescan publishes a new `Topology`. Bus ids are always the canonical lowercase sysfs form `dddd:bb:dd.f`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

# Also imported from here by the placement code; they live with the other host formats.
from agent.host.busid import BusIdError, normalize_bus_id


class Level(enum.IntEnum):
    """nvidia-smi / NCCL distance between two PCIe devices; a lower value means closer.

    PIX: under the same nearest PCIe switch. PXB: through several switches, no host bridge.
    P2C: NCCL's level for a GPU on a Grace/Vera C2C link and a NIC on PCIe of the same CPU (nvidia-smi prints SYS
    there); here any two devices under the root ports of one Grace/Vera socket. PHB: through a PCIe host bridge
    (the CPU). NODE: between host bridges of one NUMA node. SYS: across the SMP interconnect between NUMA nodes.
    Compare levels by order, never by number: P2C was added between PXB and PHB.
    """

    X = 0
    PIX = 1
    PXB = 2
    P2C = 3
    PHB = 4
    NODE = 5
    SYS = 6

    @classmethod
    def parse(cls, text: str) -> Level:
        """Level from its name (case-insensitive)."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown topology level {text!r}; expected one of {[m.name for m in cls]}") from None


@dataclass(frozen=True)
class Location:
    """Where a device sits in the PCIe hierarchy, reduced to what distance needs.

    `root` is the root complex (`pci0000:16` in sysfs, `cpu0` for an NCCL XML CPU element); `switches` is the
    chain of PCIe switches from the root down to the device's nearest switch, each named by its upstream
    port. This is NCCL's tree: it climbs two path elements at a time (device -> downstream port -> upstream
    port), so root ports drop out and two devices under one switch share their last element.
    """

    root: str
    switches: tuple[str, ...] = ()
    numa: int | None = None
    # the sysfs root complex when the NCCL XML placed the device under a CPU (`root` is then `cpu0`): DRA's
    # standard pcieRoot attribute names the real PCI root; distance never reads it
    pci_root: str = field(default="", compare=False)
    # under a Grace/Vera root port: the CPU reaches the device over its own PCIe, and a GPU there talks to the CPU
    # over NVLink-C2C; two such devices of one NUMA node are P2C apart (NCCL), closer than any PHB/NODE pair
    c2c: bool = False

    def level_to(self, other: Location) -> Level:
        """Distance to another location, as nvidia-smi would print it (plus NCCL's P2C on Grace/Vera)."""
        if self.root == other.root and self.switches:
            if self.switches == other.switches:
                return Level.PIX
            if other.switches and self.switches[0] == other.switches[0]:
                return Level.PXB
        if self.c2c and other.c2c and self.numa is not None and self.numa == other.numa:
            return Level.P2C
        if self.root == other.root:
            return Level.PHB
        if self.numa is not None and other.numa is not None and self.numa != other.numa:
            return Level.SYS
        return Level.NODE


@dataclass(frozen=True)
class PciInfo:
    """Identity and link facts of one PCI function, as sysfs reports them."""

    bus_id: str
    vendor: str = ""  # "0x15b3"
    device: str = ""  # "0x1021"
    pci_class: str = ""  # "0x020700"
    driver: str = ""
    link_speed: str = ""  # max_link_speed, e.g. "32.0 GT/s PCIe"
    link_width: str = ""  # max_link_width, e.g. "16"
    iommu_group: str = ""  # the `iommu_group` link's group number, e.g. "47" ("" without an IOMMU)
    vfio_noiommu: bool = False  # the group is vfio's no-IOMMU group (a VM without vIOMMU): /dev/vfio/noiommu-<n>
    uio: str = ""  # the UIO device of a function bound to uio_pci_generic / igb_uio, e.g. "uio0"


@dataclass(frozen=True)
class RdmaCharDevices:
    """The /dev/infiniband nodes that belong to one RDMA device (names only, e.g. `uverbs3`)."""

    uverbs: str | None = None
    umad: tuple[str, ...] = ()
    issm: tuple[str, ...] = ()


@dataclass(frozen=True)
class RdmaPort:
    """One port of an RDMA device (`infiniband/<dev>/ports/<n>`)."""

    number: int
    state: str = ""  # ACTIVE, DOWN, ...
    link_layer: str = ""  # InfiniBand or Ethernet


@dataclass(frozen=True)
class MigDevice:
    """One MIG device (a compute instance of a GPU instance) of a GPU in MIG mode, as NVML names it.

    It sits where its parent GPU sits: placement, NIC alignment and health go by the parent's bus id.
    `profile` is NVIDIA's name (`1g.10gb`, `1c.2g.20gb`), `index` its position among the parent's MIG devices.
    """

    uuid: str  # MIG-<uuid>
    index: int
    gpu_instance: int
    compute_instance: int
    profile: str
    gpu_slices: int = 1
    compute_slices: int = 1


@dataclass(frozen=True)
class Gpu:
    """One GPU. `index` is its position in bus-id order (what nvidia-smi shows without MIG)."""

    index: int
    pci: PciInfo
    location: Location
    uuid: str | None = None
    minor: int | None = None  # N of /dev/nvidiaN, from NVML
    mig_enabled: bool = False  # MIG mode on (NVML's current mode)
    mig_devices: tuple[MigDevice, ...] = ()  # its MIG devices, in NVML's order (MIG mode only)
    # how its data reaches its RDMA NICs (`locality`): pcie-switch | data-direct | c2c, "" when no NIC is near
    gpu_direct_path: str = ""
    gpu_direct_group: str = ""  # sw:<upstream port bus id> or numa:<n>; equal on a GPU and the NICs of its path

    def mig_device(self, gpu_instance: int) -> MigDevice | None:
        """The MIG device of this GPU instance (the first compute instance of it), or None."""
        return next((m for m in self.mig_devices if m.gpu_instance == gpu_instance), None)

    @property
    def bus_id(self) -> str:
        """Canonical bus id."""
        return self.pci.bus_id

    @property
    def numa(self) -> int | None:
        """NUMA node, None when the platform reports none (-1)."""
        return self.location.numa


@dataclass(frozen=True)
class Vf:
    """An SR-IOV virtual function of a NIC. It takes its PF's position in the PCIe tree."""

    pci: PciInfo
    pf_bus_id: str
    vf_index: int
    rdma: str | None = None  # e.g. mlx5_12
    netdevs: tuple[str, ...] = ()
    link_type: str = ""  # "infiniband" or "ether"
    chardevs: RdmaCharDevices = field(default_factory=RdmaCharDevices)
    ports: tuple[RdmaPort, ...] = ()
    gpu_direct_path: str = ""  # as its PF's, or by its own path (`Topology.data_direct_vfs` false)
    gpu_direct_group: str = ""

    @property
    def bus_id(self) -> str:
        """Canonical bus id."""
        return self.pci.bus_id


@dataclass(frozen=True)
class Nic:
    """A network physical function; `rdma` is set when it is an RDMA device (InfiniBand or RoCE)."""

    pci: PciInfo
    location: Location
    rdma: str | None = None
    netdevs: tuple[str, ...] = ()
    link_type: str = ""  # "infiniband" or "ether", from the netdev's ARPHRD type
    chardevs: RdmaCharDevices = field(default_factory=RdmaCharDevices)
    ports: tuple[RdmaPort, ...] = ()
    sriov_totalvfs: int = 0
    vfs: tuple[Vf, ...] = ()
    # ConnectX-8 Data Direct: the bus id of its DMA function (15b3:2100, paired by VPD keyword V3) and that
    # function's location, where its GPU traffic enters PCIe: every locality decision places the NIC there
    data_direct_function: str = ""
    data_path: Location | None = None
    gpu_direct_path: str = ""
    gpu_direct_group: str = ""

    @property
    def bus_id(self) -> str:
        """Canonical bus id."""
        return self.pci.bus_id

    @property
    def numa(self) -> int | None:
        """NUMA node, None when unknown."""
        return self.location.numa

    @property
    def is_rdma(self) -> bool:
        """True for RDMA-capable functions."""
        return self.rdma is not None


@dataclass(frozen=True)
class Topology:
    """The whole node: GPUs in index order, NICs (physical functions) in bus-id order."""

    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()
    source: str = "sysfs"
    default_route_netdevs: frozenset[str] = frozenset()  # the node's uplinks: never handed to a pod
    # `topology.dataDirectVfs`: a Data Direct PF's VFs sit at its DMA function too (false: at the PF's own place)
    data_direct_vfs: bool = True
    # what kept a locality fact from being read (an unreadable `vpd`), one line each, for `doctor`
    locality_problems: tuple[str, ...] = ()

    def data_path(self, nic: Nic) -> Location:
        """Where a NIC's GPU traffic enters PCIe: its DMA function's location (Data Direct), else its own."""
        return nic.data_path or nic.location

    def unit_location(self, nic: Nic) -> Location:
        """Where the devices a NIC serves (its VFs, or the PF when it has none) are placed."""
        if nic.vfs and not self.data_direct_vfs:
            return nic.location
        return self.data_path(nic)

    @cached_property
    def _locations(self) -> dict[str, Location]:
        locations: dict[str, Location] = {}
        for gpu in self.gpus:
            locations[gpu.bus_id] = gpu.location
        for nic in self.nics:
            locations[nic.bus_id] = self.data_path(nic)
            for vf in nic.vfs:
                locations[vf.bus_id] = self.unit_location(nic)
        return locations

    @cached_property
    def _by_bus_id(self) -> dict[str, Gpu | Nic | Vf]:
        found: dict[str, Gpu | Nic | Vf] = {gpu.bus_id: gpu for gpu in self.gpus}
        for nic in self.nics:
            found[nic.bus_id] = nic
            found.update((vf.bus_id, vf) for vf in nic.vfs)
        return found

    @property
    def rdma_nics(self) -> tuple[Nic, ...]:
        """RDMA-capable physical functions."""
        return tuple(nic for nic in self.nics if nic.is_rdma)

    def find(self, bus_id: str) -> Gpu | Nic | Vf | None:
        """The GPU, NIC or VF with this bus id (any accepted form), or None."""
        try:
            return self._by_bus_id.get(normalize_bus_id(bus_id))
        except BusIdError:
            return None

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        """The GPU with this NVML UUID, or None."""
        return next((gpu for gpu in self.gpus if gpu.uuid == uuid), None)

    @cached_property
    def _mig_parents(self) -> dict[str, tuple[Gpu, MigDevice]]:
        return {mig.uuid: (gpu, mig) for gpu in self.gpus for mig in gpu.mig_devices}

    def mig_device(self, uuid: str) -> tuple[Gpu, MigDevice] | None:
        """The parent GPU and the MIG device with this MIG UUID, or None."""
        return self._mig_parents.get(uuid)

    def gpu_of(self, device_id: str) -> Gpu | None:
        """The GPU a device ID names: a GPU UUID, a MIG UUID (its parent), or a GPU bus id; None otherwise."""
        found = self._mig_parents.get(device_id)
        if found is not None:
            return found[0]
        gpu = self.gpu_by_uuid(device_id)
        if gpu is None:
            located = self.find(device_id)
            gpu = located if isinstance(located, Gpu) else None
        return gpu

    def location(self, bus_id: str) -> Location:
        """Location of a GPU, NIC or VF for locality: a NIC's data path, VFs as `unit_location`. KeyError for
        unknown devices."""
        return self._locations[normalize_bus_id(bus_id)]

    def level(self, a: str, b: str) -> Level:
        """Distance between two devices given by bus id; X for the same function."""
        a, b = normalize_bus_id(a), normalize_bus_id(b)
        if a == b:
            return Level.X
        return self._locations[a].level_to(self._locations[b])
