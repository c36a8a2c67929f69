"""Read GPUs and NICs, and their places in the PCIe tree, from a sysfs tree.

The same code reads the host's `/sys` and a simulated tree (`gpu-node-agent simulate-node`), so it relies only
on the kernel's layout: `bus/pci/devices/<BDF>` links into `devices/pci<dom>:<bus>/<bridge>/.../<BDF>`, whose
path elements are the chain of bridges above the device. A device whose files are missing, unreadable or
garbage is skipped with one warning naming the path; reading never raises for bad input.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from agent.host.busid import is_bus_id, normalize_bus_id
from agent.topology import data_direct, locality
from agent.topology.model import (
    Gpu,
    Location,
    Nic,
    PciInfo,
    RdmaCharDevices,
    RdmaPort,
    Topology,
    Vf,
)
from agent.topology.sysfs_file import read_sysfs_file

log = logging.getLogger(__name__)

NVIDIA_VENDOR = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)  # VGA-compatible and 3D controllers (data-centre GPUs are 0x0302)
NETWORK_BASE_CLASS = 0x02
_ROOT_COMPLEX = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_GROUP = re.compile(r"^[0-9]{1,9}$")  # /sys/kernel/iommu_groups/<n>
_UIO = re.compile(r"^uio[0-9]{1,9}$")  # /dev/uio<n>
_ARPHRD_LINK_TYPES = {"1": "ether", "32": "infiniband"}



class _RdmaFields(TypedDict):
    """The RDMA side of one PCI function, as keyword arguments for `Nic` and `Vf`."""

    rdma: str | None
    netdevs: tuple[str, ...]
    link_type: str
    ports: tuple[RdmaPort, ...]
    chardevs: RdmaCharDevices

class SkipDevice(Exception):
    """A device that cannot be read; the message names the path and the problem."""


@dataclass
class _Function:
    """One PCI function as read from sysfs, before it is classified."""

    path: Path
    pci: PciInfo
    class_code: int
    vendor_id: int
    location: Location
    physfn: str | None = None
    virtfns: list[tuple[int, str]] = field(default_factory=list)
    device_id: int = 0
    dma: bool = False  # a ConnectX-8 Data Direct DMA function: neither a NIC nor a GPU, a NIC's data path


MAX_ATTRIBUTE = 64 << 10  # a sysfs text attribute is at most a page; read no more than this of anything


def _read(path: Path) -> str | None:
    """File content stripped, or None when the file does not exist. Other errors raise SkipDevice.

    Opened non-blocking and refused unless a regular file (sysfs attributes are): a FIFO or device planted in a
    tree the agent reads must not block the topology scan; at most MAX_ATTRIBUTE bytes are read."""
    try:
        data = read_sysfs_file(path, MAX_ATTRIBUTE)
    except OSError as exc:
        raise SkipDevice(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if data is None:
        return None
    return data.decode("ascii", errors="replace").strip()


def _read_optional(path: Path) -> str | None:
    """Like _read, but an unreadable optional file is logged and treated as absent."""
    try:
        return _read(path)
    except SkipDevice as exc:
        log.warning("ignoring unreadable file %s", exc)
        return None


def _hex(path: Path) -> int:
    text = _read(path)
    if text is None:
        raise SkipDevice(f"{path}: missing")
    try:
        return int(text, 16)
    except ValueError:
        raise SkipDevice(f"{path}: not a hex number: {text[:40]!r}") from None


def _link_name(path: Path) -> str | None:
    """Basename of a symlink's target (driver, physfn, virtfn), or None when absent."""
    try:
        return os.path.basename(os.readlink(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SkipDevice(f"{path}: unreadable link ({exc.strerror or exc})") from exc


def switch_chain(elements: list[str]) -> tuple[str, ...]:
    """NCCL's PCI nodes above a device, root first: every second path element climbing from the device.

    NCCL "rewinds two '/'" from a device to find its parent (device -> downstream port -> upstream port), so
    two devices behind different downstream ports of one switch share a parent, and root ports drop out.
    `elements` is the resolved path below `devices/`: root complex, bridges, device.
    """
    nearest_first: list[str] = []
    index = len(elements) - 3
    while index >= 1:
        nearest_first.append(elements[index])
        index -= 2
    return tuple(reversed(nearest_first))


class SysfsReader:
    """Builds a `Topology` from the sysfs tree under `root` (the host's `/sys` by default)."""

    def __init__(self, root: Path | str = Path("/sys"), *, data_direct_vfs: bool = True) -> None:
        self.root = Path(root)
        self.data_direct_vfs = data_direct_vfs
        self._c2c_ports: dict[Path, bool] = {}

    def read(self, gpu_uuids: Mapping[str, str] | None = None) -> Topology:
        """Read the tree; `gpu_uuids` maps bus ids (any form) to NVML UUIDs when NVML knows them."""
        uuids = {normalize_bus_id(k): v for k, v in (gpu_uuids or {}).items() if is_bus_id(k)}
        self._c2c_ports = {}
        functions = self._functions()
        gpus = [f for f in functions.values() if self._is_gpu(f)]
        gpus.sort(key=lambda f: f.pci.bus_id)
        problems: list[str] = []
        dma_of = data_direct.pair(
            [f for f in functions.values() if f.dma],
            [f for f in functions.values() if self._is_network(f) and f.physfn is None
             and f.vendor_id == locality.MELLANOX_VENDOR], problems) if any(f.dma for f in functions.values()) else {}
        return locality.annotate(Topology(
            gpus=tuple(
                Gpu(index=i, pci=f.pci, location=f.location, uuid=uuids.get(f.pci.bus_id))
                for i, f in enumerate(gpus)
            ),
            nics=tuple(self._nics(functions, dma_of)),
            source="sysfs",
            data_direct_vfs=self.data_direct_vfs,
            locality_problems=tuple(problems),
        ))

    @staticmethod
    def _is_gpu(f: _Function) -> bool:
        return f.vendor_id == NVIDIA_VENDOR and (f.class_code >> 8) in GPU_CLASSES and not f.dma

    @staticmethod
    def _is_network(f: _Function) -> bool:
        return (f.class_code >> 16) == NETWORK_BASE_CLASS and not f.dma

    def _functions(self) -> dict[str, _Function]:
        devices_dir = self.root / "bus" / "pci" / "devices"
        try:
            names = sorted(os.listdir(devices_dir))
        except OSError as exc:
            log.warning("no PCI devices readable under %s (%s); the node model is empty",
                        devices_dir, exc.strerror or exc)
            return {}
        functions: dict[str, _Function] = {}
        for name in names:
            try:
                function = self._function(devices_dir / name)
            except SkipDevice as exc:
                log.warning("skipping PCI device: %s", exc)
                continue
            if function is not None:
                functions[function.pci.bus_id] = function
        return functions

    def _function(self, link: Path) -> _Function | None:
        if not is_bus_id(link.name):
            raise SkipDevice(f"{link}: not a PCI bus id")
        try:
            path = link.resolve(strict=True)
        except (OSError, RuntimeError) as exc:
            raise SkipDevice(f"{link}: dangling or looping link ({exc})") from exc
        devices_root = (self.root / "devices").resolve()
        try:
            elements = list(path.relative_to(devices_root).parts)
        except ValueError:
            raise SkipDevice(f"{link}: resolves outside {devices_root}: {path}") from None
        if len(elements) < 2 or not _ROOT_COMPLEX.match(elements[0].lower()) \
                or not all(is_bus_id(e) for e in elements[1:]):
            raise SkipDevice(f"{link}: unexpected device path {path}")
        bus_id = normalize_bus_id(elements[-1])
        class_code = _hex(path / "class")
        dma = False
        if not (self._is_network_code(class_code) or (class_code >> 8) in GPU_CLASSES):
            # bridges, storage and the rest are not part of the model; a Data Direct DMA function is, as a NIC's
            # data path, recognised by its ids whatever its (unpublished) class says
            if (class_code >> 8) == 0x0604:
                return None
            dma = self._is_dma(path)
            if not dma:
                return None
        vendor_id = _hex(path / "vendor")
        device_id = _hex(path / "device")
        dma = dma or (vendor_id, device_id) == (locality.MELLANOX_VENDOR, locality.DATA_DIRECT_DMA_DEVICE)
        numa = self._numa(path / "numa_node")
        pci = PciInfo(
            bus_id=bus_id,
            vendor=f"0x{vendor_id:04x}",
            device=f"0x{device_id:04x}",
            pci_class=f"0x{class_code:06x}",
            driver=_link_name(path / "driver") or "",
            link_speed=_read_optional(path / "max_link_speed") or "",
            link_width=_read_optional(path / "max_link_width") or "",
            **self._userspace(path),
        )
        # C2C (`Location.c2c`): only GPUs, ConnectX PFs and DMA functions under a Grace/Vera root port, as
        # rdma_topo's NUMA complex (a BlueField there is not on a GPU's data path)
        on_c2c = dma or (vendor_id == NVIDIA_VENDOR and (class_code >> 8) in GPU_CLASSES) or (
            vendor_id == locality.MELLANOX_VENDOR and device_id in locality.CONNECTX_PF_DEVICES)
        location = Location(root=elements[0].lower(), switches=switch_chain(elements), numa=numa,
                            c2c=on_c2c and self._c2c_root_port(devices_root, elements))
        physfn = _link_name(path / "physfn")
        virtfns = []
        for entry in path.glob("virtfn*"):
            suffix = entry.name.removeprefix("virtfn")
            target = _link_name(entry)
            if suffix.isdigit() and target and is_bus_id(target):
                virtfns.append((int(suffix), normalize_bus_id(target)))
        return _Function(path=path, pci=pci, class_code=class_code, vendor_id=vendor_id, location=location,
                         physfn=normalize_bus_id(physfn) if physfn and is_bus_id(physfn) else None,
                         virtfns=sorted(virtfns), device_id=device_id, dma=dma)

    @staticmethod
    def _is_dma(path: Path) -> bool:
        try:
            ids = (_hex(path / "vendor"), _hex(path / "device"))
        except SkipDevice:
            return False
        return ids == (locality.MELLANOX_VENDOR, locality.DATA_DIRECT_DMA_DEVICE)

    def _c2c_root_port(self, devices_root: Path, elements: list[str]) -> bool:
        """Whether the device hangs below a Grace/Vera root port (its path's first bridge), read once per port."""
        if len(elements) < 3:
            return False
        port = devices_root / elements[0] / elements[1]
        known = self._c2c_ports.get(port)
        if known is None:
            try:
                known = (_hex(port / "vendor"), _hex(port / "device")) in locality.C2C_ROOT_PORTS
            except SkipDevice:
                known = False
            self._c2c_ports[port] = known
        return known

    @staticmethod
    def _userspace(path: Path) -> dict[str, Any]:
        """IOMMU group and UIO device: what a function bound to vfio-pci or a UIO driver is opened through. Both
        become device paths in Allocate, so only the kernel's own name forms are kept (a group number, `uio<N>`)."""
        found: dict[str, Any] = {}
        group = _link_name(path / "iommu_group")
        if group is not None and _GROUP.match(group):
            found["iommu_group"] = group
            found["vfio_noiommu"] = _read_optional(path / "iommu_group" / "name") == "vfio-noiommu"
        elif group is not None:
            log.warning("ignoring %s: not an IOMMU group number: %r", path / "iommu_group", group[:40])
        uio = [name for name in sorted(_listdir(path / "uio")) if _UIO.match(name)]
        if uio:
            found["uio"] = uio[0]
        return found

    @staticmethod
    def _is_network_code(class_code: int) -> bool:
        return (class_code >> 16) == NETWORK_BASE_CLASS

    @staticmethod
    def _numa(path: Path) -> int | None:
        text = _read_optional(path)
        if text is None:
            return None
        try:
            value = int(text)
        except ValueError:
            log.warning("ignoring %s: not an integer: %r", path, text[:40])
            return None
        return value if value >= 0 else None

    def _nics(self, functions: dict[str, _Function], dma_of: Mapping[str, _Function]) -> list[Nic]:
        nics: list[Nic] = []
        for f in sorted(functions.values(), key=lambda f: f.pci.bus_id):
            if not self._is_network(f) or f.physfn is not None:
                continue
            try:
                rdma = self._rdma(f.path)
                vfs = tuple(self._vfs(f, functions))
                totalvfs = _read_optional(f.path / "sriov_totalvfs")
                dma = dma_of.get(f.pci.bus_id)
                nics.append(Nic(
                    pci=f.pci, location=f.location, vfs=vfs,
                    sriov_totalvfs=int(totalvfs) if totalvfs and totalvfs.isdigit() else 0,
                    data_direct_function=dma.pci.bus_id if dma else "",
                    data_path=dma.location if dma else None,
                    **rdma,
                ))
            except SkipDevice as exc:
                log.warning("skipping NIC %s: %s", f.pci.bus_id, exc)
        orphans = [f.pci.bus_id for f in functions.values()
                   if f.physfn is not None and (f.physfn not in functions or f.physfn == f.pci.bus_id)]
        for bus_id in orphans:
            log.warning("skipping VF %s: its physical function is not readable", bus_id)
        return nics

    def _vfs(self, pf: _Function, functions: dict[str, _Function]) -> list[Vf]:
        by_bus_id = {bus_id: index for index, bus_id in pf.virtfns}
        vfs: list[Vf] = []
        for f in functions.values():
            if f.physfn != pf.pci.bus_id:
                continue
            index = by_bus_id.get(f.pci.bus_id)
            if index is None:
                log.warning("VF %s names %s as its PF, but the PF has no virtfn link to it; using it anyway",
                            f.pci.bus_id, pf.pci.bus_id)
                index = len(by_bus_id) + len(vfs)
            try:
                vfs.append(Vf(pci=f.pci, pf_bus_id=pf.pci.bus_id, vf_index=index, **self._rdma(f.path)))
            except SkipDevice as exc:
                log.warning("skipping VF %s: %s", f.pci.bus_id, exc)
        return sorted(vfs, key=lambda vf: vf.vf_index)

    def _rdma(self, path: Path) -> _RdmaFields:
        """RDMA device, ports, char devices, netdevs and link type of one function."""
        netdevs = tuple(sorted(_listdir(path / "net")))
        ibdevs = sorted(_listdir(path / "infiniband"))
        rdma = ibdevs[0] if ibdevs else None
        ports: list[RdmaPort] = []
        if rdma is not None:
            ports_dir = path / "infiniband" / rdma / "ports"
            for name in sorted(_listdir(ports_dir), key=lambda n: int(n) if n.isdigit() else 0):
                if not name.isdigit():
                    continue
                state = _read_optional(ports_dir / name / "state") or ""
                ports.append(RdmaPort(
                    number=int(name),
                    state=state.split(":", 1)[-1].strip(),  # "4: ACTIVE" -> ACTIVE
                    link_layer=_read_optional(ports_dir / name / "link_layer") or "",
                ))
        link_type = ""
        for netdev in netdevs:
            link_type = _ARPHRD_LINK_TYPES.get(_read_optional(path / "net" / netdev / "type") or "", "")
            if link_type:
                break
        if not link_type and ports:
            link_type = "infiniband" if ports[0].link_layer.lower() == "infiniband" else "ether"
        verbs = sorted(n for n in _listdir(path / "infiniband_verbs") if n.startswith("uverbs"))
        mads = sorted(_listdir(path / "infiniband_mad"))
        return {
            "rdma": rdma,
            "netdevs": netdevs,
            "link_type": link_type,
            "ports": tuple(ports),
            "chardevs": RdmaCharDevices(
                uverbs=verbs[0] if verbs else None,
                umad=tuple(n for n in mads if n.startswith("umad")),
                issm=tuple(n for n in mads if n.startswith("issm")),
            ),
        }


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SkipDevice(f"{path}: cannot list ({exc.strerror or exc})") from exc
