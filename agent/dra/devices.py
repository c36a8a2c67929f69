"""The node's GPUs and RDMA functions as DRA devices: stable names and the attributes the scheduler matches on.

One `DraDevice` per GPU and per RDMA function the agent serves (every VF on bare metal; a VF-less RDMA PF, as a
passed-through NIC on a VM, unless it carries the node's default route). A GPU in MIG mode is published as its
MIG devices *instead of* itself, as NVIDIA's DRA driver publishes them: a GPU and its MIG devices side by side
would let two claims hold one GPU. Names derive from the bus id (a MIG device's from its parent's, its GPU and
compute instance ids after it), so they survive restarts and rescans. Attributes follow
`/work/shared/reference/dra.md` sections 5.2, 7 and 11:

- standard `resource.kubernetes.io/pciBusID`, `pcieRoot` (`pci<domain>:<bus>` of the root complex as sysfs
  shows it, also when the NCCL XML moved the device under a CPU) and `numaNode` (a plain int, left out when the
  platform reports none);
- `gpunodeagent.io/pcieSwitch`: the device's nearest PCIe switch; two devices carry the same value exactly when
  they sit under one switch (PIX). `gpunodeagent.io/pcieSwitchGroup`: the top switch below the root; equal for
  devices that meet in a switch below the root (PXB or closer). Devices directly on a root port carry neither,
  so a `matchAttribute` on them never pairs a device across the host bridge;
- `gpunodeagent.io/gpuDirectPath` (`pcie-switch`, `data-direct`, `c2c`) and `gpunodeagent.io/gpuDirectGroup`
  (`sw:<bus id>`, `numa:<n>`) on GPUs, MIG devices and RDMA functions that have a GPU nearby
  (`agent.topology.locality`): one `matchAttribute` on the group pairs a GPU with its NIC on every shape; RDMA
  functions of a ConnectX-8 Data Direct NIC also carry `gpunodeagent.io/dataDirectFunction` (the DMA function's
  bus id), and their switch attributes name the DMA function's switches, where their GPU traffic enters PCIe
  (`pciBusID` and `pcieRoot` stay their own);
- GPU `uuid` and `product`; a MIG device carries its parent's placement attributes and product (it sits where
  its parent sits, so GPU-NIC `matchAttribute` constraints work for it), its own MIG `uuid`, `parentUUID` and
  `migProfile` (`1g.10gb`); RDMA `rdmaDevice`, `pfName`, `linkType`; and Multus' `k8s.cni.cncf.io/deviceID`
  and `k8s.cni.cncf.io/resourceName`, which SR-IOV CNI needs to attach the VF.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Literal

from agent.topology.locality import PATH_DATA_DIRECT
from agent.topology.model import Gpu, Location, MigDevice, Nic, Topology, Vf

STANDARD = "resource.kubernetes.io"
MULTUS = "k8s.cni.cncf.io"
DOMAIN = "gpunodeagent.io"  # attribute domain; fixed even when the driver name is configured differently

MAX_STRING = 64  # DeviceAttribute string and version values
MAX_ATTRIBUTES = 32  # attributes + capacities per device
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")

# NVML product names by PCI device id (what `nvidia-smi --query-gpu=name` prints for these boards)
_PRODUCTS = {
    "0x20b0": "NVIDIA A100-SXM4-40GB", "0x20b2": "NVIDIA A100-SXM4-80GB", "0x20b5": "NVIDIA A100 80GB PCIe",
    "0x20f1": "NVIDIA A100-PCIE-40GB", "0x2330": "NVIDIA H100 80GB HBM3", "0x2331": "NVIDIA H100 PCIe",
    "0x2335": "NVIDIA H200", "0x2321": "NVIDIA H100 NVL", "0x2324": "NVIDIA H800", "0x26b5": "NVIDIA L40",
    "0x26b9": "NVIDIA L40S", "0x27b8": "NVIDIA L4", "0x2901": "NVIDIA B200",
}

DeviceKind = Literal["gpu", "mig", "rdma"]
Attribute = dict[str, Any]  # one DeviceAttribute: {"string": ...} | {"int": ...} | {"bool": ...}


class AttributeLimitError(ValueError):
    """A device that the API server would refuse (name, attribute count, value length)."""


@dataclass(frozen=True)
class DraDevice:
    """One device in the node's pool: its name, kind, bus id and the hardware it stands for."""

    name: str
    kind: DeviceKind
    bus_id: str
    attributes: dict[str, Attribute]
    gpu: Gpu | None = None  # the GPU, or a MIG device's parent
    function: Vf | Nic | None = None  # the RDMA function (a VF, or a VF-less PF)
    pf: Nic | None = None
    mig: MigDevice | None = None

    @property
    def health_id(self) -> str:
        """The id health events use for this device: the MIG UUID, the GPU UUID, or the function's bus id."""
        if self.mig is not None:
            return self.mig.uuid
        if self.gpu is not None and self.gpu.uuid:
            return self.gpu.uuid
        return self.bus_id

    @property
    def health_ids(self) -> tuple[str, ...]:
        """Every id whose fault makes this device Unhealthy: its own, and a MIG device's parent GPU's."""
        if self.mig is not None and self.gpu is not None and self.gpu.uuid:
            return (self.mig.uuid, self.gpu.uuid)
        return (self.health_id,)


def device_name(kind: DeviceKind, bus_id: str) -> str:
    """DNS-label name from the bus id: `gpu-0000-3b-00-0`, `rdma-0000-3b-02-2`."""
    return f"{kind}-" + re.sub(r"[:.]", "-", bus_id)


def mig_device_name(parent_bus_id: str, mig: MigDevice) -> str:
    """`gpu-0000-1b-00-0-mig-3-0`: the parent's name, then GPU and compute instance ids (unique on the GPU)."""
    return f"{device_name('gpu', parent_bus_id)}-mig-{mig.gpu_instance}-{mig.compute_instance}"


def share_hardware(name: str, other: str) -> bool:
    """True when two of our device names stand for overlapping hardware: the same device, or a whole GPU and
    one of its MIG devices (a repartition between prepare and unprepare must not hand a GPU out twice)."""
    return name == other or name.startswith(f"{other}-mig-") or other.startswith(f"{name}-mig-")


def _string(value: str) -> Attribute:
    if len(value) > MAX_STRING:  # keep equality, lose readability: a hash of the full value
        value = f"{value[:40]}~{hashlib.sha256(value.encode()).hexdigest()[:16]}"
    return {"string": value}


def pcie_root(location: Location) -> str | None:
    """The standard attribute's `pci<domain>:<bus>` form, None when no PCI root is known."""
    root = (location.pci_root or location.root).lower()
    return root if _PCIE_ROOT.match(root) else None


def placement_attributes(bus_id: str, location: Location, data_path: Location | None = None, *,
                         gpu_direct: tuple[str, str] = ("", "")) -> dict[str, Attribute]:
    """Bus id, root, NUMA node, switch and GPUDirect attributes shared by GPUs and NICs. `data_path`: where the
    device's GPU traffic enters PCIe when that is not its own place (a Data Direct NIC's DMA function); the switch
    attributes follow it. `gpu_direct`: (path, group), "" when no GPU is near."""
    attributes: dict[str, Attribute] = {f"{STANDARD}/pciBusID": {"string": bus_id}}
    if (root := pcie_root(location)) is not None:
        attributes[f"{STANDARD}/pcieRoot"] = {"string": root}
    if location.numa is not None and location.numa >= 0:
        attributes[f"{STANDARD}/numaNode"] = {"int": location.numa}
    switches = (data_path or location).switches
    if switches:
        # a switch name is unique in the node (an upstream port's bus id, or `<cpu>/<busid>` from the XML) and
        # a switch has one parent, so the nearest switch alone identifies the whole chain
        attributes[f"{DOMAIN}/pcieSwitch"] = _string(switches[-1])
        attributes[f"{DOMAIN}/pcieSwitchGroup"] = _string(switches[0])
    path, group = gpu_direct
    if group:
        attributes[f"{DOMAIN}/gpuDirectPath"] = _string(path)
        attributes[f"{DOMAIN}/gpuDirectGroup"] = _string(group)
    return attributes


def _product(gpu: Gpu) -> Attribute:
    return _string(_PRODUCTS.get(gpu.pci.device.lower(), f"pci-{gpu.pci.vendor}-{gpu.pci.device}".replace("0x", "")))


def gpu_device(gpu: Gpu) -> DraDevice:
    """A whole GPU."""
    attributes = {f"{DOMAIN}/type": {"string": "gpu"}, **placement_attributes(
        gpu.bus_id, gpu.location, gpu_direct=(gpu.gpu_direct_path, gpu.gpu_direct_group))}
    if gpu.uuid:
        attributes[f"{DOMAIN}/uuid"] = _string(gpu.uuid)
    attributes[f"{DOMAIN}/product"] = _product(gpu)
    return DraDevice(device_name("gpu", gpu.bus_id), "gpu", gpu.bus_id, attributes, gpu=gpu)


def mig_device(gpu: Gpu, mig: MigDevice) -> DraDevice:
    """A MIG device of `gpu`, placed where its parent is (its bus id is the parent's)."""
    attributes = {f"{DOMAIN}/type": {"string": "mig"}, **placement_attributes(
                      gpu.bus_id, gpu.location, gpu_direct=(gpu.gpu_direct_path, gpu.gpu_direct_group)),
                  f"{DOMAIN}/uuid": _string(mig.uuid), f"{DOMAIN}/migProfile": _string(mig.profile)}
    if gpu.uuid:
        attributes[f"{DOMAIN}/parentUUID"] = _string(gpu.uuid)
    attributes[f"{DOMAIN}/product"] = _product(gpu)
    return DraDevice(mig_device_name(gpu.bus_id, mig), "mig", gpu.bus_id, attributes, gpu=gpu, mig=mig)


def gpu_devices(gpu: Gpu) -> list[DraDevice]:
    """What a GPU is in the pool: itself, or, in MIG mode, its MIG devices (none while it has none)."""
    if gpu.mig_enabled:
        return [mig_device(gpu, mig) for mig in sorted(gpu.mig_devices, key=lambda m: (m.gpu_instance,
                                                                                       m.compute_instance))]
    return [gpu_device(gpu)]


def rdma_device(function: Vf | Nic, pf: Nic, resource_name: str) -> DraDevice:
    """An RDMA function; it takes its PF's place in the PCIe tree (its data path: see the module docstring)."""
    data_direct = function.gpu_direct_path == PATH_DATA_DIRECT and pf.data_path is not None
    attributes = {f"{DOMAIN}/type": {"string": "rdma"}, **placement_attributes(
        function.bus_id, pf.location, pf.data_path if data_direct else None,
        gpu_direct=(function.gpu_direct_path, function.gpu_direct_group))}
    if data_direct:
        attributes[f"{DOMAIN}/dataDirectFunction"] = {"string": pf.data_direct_function}
    if function.rdma:
        attributes[f"{DOMAIN}/rdmaDevice"] = _string(function.rdma)
    if pf.netdevs:
        attributes[f"{DOMAIN}/pfName"] = _string(pf.netdevs[0])
    link = function.link_type or pf.link_type
    if link:
        attributes[f"{DOMAIN}/linkType"] = _string(link)
    attributes[f"{MULTUS}/deviceID"] = {"string": function.bus_id}
    attributes[f"{MULTUS}/resourceName"] = _string(resource_name)
    return DraDevice(device_name("rdma", function.bus_id), "rdma", function.bus_id, attributes,
                     function=function, pf=pf)


def rdma_functions(topology: Topology) -> list[tuple[Vf | Nic, Nic]]:
    """Every RDMA VF, and each VF-less RDMA PF that does not carry the node's default route, in bus-id order."""
    found: list[tuple[Vf | Nic, Nic]] = []
    for nic in sorted(topology.rdma_nics, key=lambda n: n.bus_id):
        if nic.vfs:
            found.extend((vf, nic) for vf in sorted(nic.vfs, key=lambda v: v.bus_id) if vf.rdma is not None)
        elif not set(nic.netdevs) & topology.default_route_netdevs:
            found.append((nic, nic))
    return found


def node_devices(topology: Topology, rdma_resource_name: str, *, gpus: bool = True,
                 rdma: bool = True) -> tuple[DraDevice, ...]:
    """The pool's devices: GPUs (or their MIG devices) in index order, then RDMA functions in bus-id order; each
    checked."""
    devices: list[DraDevice] = []
    if gpus:
        for gpu in sorted(topology.gpus, key=lambda g: g.index):
            devices.extend(gpu_devices(gpu))
    if rdma:
        devices.extend(rdma_device(function, pf, rdma_resource_name) for function, pf in rdma_functions(topology))
    for device in devices:
        check_device(device.name, device.attributes)
    return tuple(devices)


def check_device(name: str, attributes: dict[str, Attribute]) -> None:
    """Raise AttributeLimitError for what `resource.k8s.io/v1` validation refuses (types.go limits)."""
    if not _DNS_LABEL.match(name):
        raise AttributeLimitError(f"device name {name!r} is not a DNS label")
    if len(attributes) > MAX_ATTRIBUTES:
        raise AttributeLimitError(f"device {name}: {len(attributes)} attributes, the limit is {MAX_ATTRIBUTES}")
    for key, value in attributes.items():
        domain, _, ident = key.rpartition("/")
        if not _C_IDENTIFIER.match(ident) or len(domain) > 63:
            raise AttributeLimitError(f"device {name}: attribute name {key!r} is not a qualified name")
        if len(value) != 1:
            raise AttributeLimitError(f"device {name}: attribute {key} must have exactly one value")
        text = value.get("string", value.get("version"))
        if isinstance(text, str) and len(text) > MAX_STRING:
            raise AttributeLimitError(f"device {name}: attribute {key} is longer than {MAX_STRING}")
