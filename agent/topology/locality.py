"""GPU-NIC locality on every current layout: which NIC is on a GPU's data path, named one way for all shapes.

Four shapes link a GPU to its RDMA NIC (`docs/locality.md`; facts in the shared reference `gpu-nic-locality.md`):

- switch (DGX/HGX H100, B200): one PCIe switch above both (PIX);
- inline (HGX B300 + ConnectX-8): the NIC's own switch, the GPU two switch levels below its upstream port (PXB);
- Data Direct (GB300, GB200 + ConnectX-8): the NIC PF sits on another PCI segment; a ConnectX-8 DMA function
  (15b3:2100) shares a ConnectX switch with the GPU, and only the VPD keyword `V3` pairs it with its PF;
- C2C (GB200 + ConnectX-7, Vera Rubin): GPU and NIC each straight under a Grace/Vera root port of one socket.

Every GPU and NIC gets `gpu_direct_path` (pcie-switch | data-direct | c2c) and `gpu_direct_group`: `sw:<bus id
of the deepest switch upstream port shared with the other side>`, or `numa:<n>` when they share no switch but
sit on C2C root ports of one NUMA node. A Data Direct NIC is placed at its DMA function for all of this (its own
bus id and root stay its identity). Pure functions over the model; the sysfs reader gathers the facts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from agent.topology.model import Location, Nic, Topology

MELLANOX_VENDOR = 0x15B3
DATA_DIRECT_DMA_DEVICE = 0x2100  # ConnectX-8 Data Direct DMA function; its PCI class is not published
CONNECTX_PF_DEVICES = frozenset({0x1021, 0x1023, 0x1025})  # ConnectX-7 / -8 / -9 PFs (rdma_topo)
# Grace and Vera CPU PCIe root ports (10de:22b1/22b2/22b8, 10de:2f95/2f96, rdma_topo's pci_device_types)
C2C_ROOT_PORTS = frozenset({(0x10DE, 0x22B1), (0x10DE, 0x22B2), (0x10DE, 0x22B8), (0x10DE, 0x2F95),
                            (0x10DE, 0x2F96)})

PATH_SWITCH = "pcie-switch"
PATH_DATA_DIRECT = "data-direct"
PATH_C2C = "c2c"

MAX_VPD = 32 << 10  # PCI VPD addresses are 15 bits


class VpdError(ValueError):
    """VPD contents that cannot be trusted; the message says what is wrong."""


def vpd_keywords(data: bytes) -> dict[str, bytes]:
    """The VPD-R (read-only) keywords of a PCI VPD image, e.g. {"SN": b"MT2412...", "V3": b"..."}.

    Format (PCI Local Bus spec, Linux drivers/pci/vpd.c): resources of large (`0x80|name`, 16-bit LE length) or
    small (`name<<3|len`) tags; 0x82 identifier string, 0x90 VPD-R (records `K1 K2 len data`, closed by `RV`
    whose first byte makes the bytes from offset 0 through it sum to 0 mod 256), 0x91 VPD-W, end tag 0x78.
    VpdError when the image is truncated, lacks VPD-R, or fails the checksum: odd contents never pair a NIC.
    """
    offset, found = 0, None
    while offset < len(data):
        tag = data[offset]
        if tag & 0x80:
            if offset + 3 > len(data):
                raise VpdError(f"large resource header truncated at offset {offset}")
            length = data[offset + 1] | data[offset + 2] << 8
            start, name = offset + 3, tag
        else:
            if (tag & 0xF8) == 0x78:
                break
            length, start, name = tag & 0x07, offset + 1, tag
        end = start + length
        if end > len(data):
            raise VpdError(f"resource 0x{name:02x} at offset {offset} runs past the end ({end} > {len(data)})")
        if name == 0x90:
            found = _read_only(data, start, end)
        offset = end
    if found is None:
        raise VpdError("no VPD-R (0x90) resource")
    return found


def _read_only(data: bytes, start: int, end: int) -> dict[str, bytes]:
    keywords: dict[str, bytes] = {}
    at = start
    while at + 3 <= end:
        key = data[at:at + 2].decode("ascii", errors="replace")
        length = data[at + 2]
        if at + 3 + length > end:
            raise VpdError(f"VPD-R keyword {key!r} runs past its resource")
        if key == "RV":
            if length < 1 or sum(data[:at + 4]) & 0xFF:
                raise VpdError("VPD-R checksum (RV) does not sum to zero")
            return keywords
        keywords[key] = data[at + 3:at + 3 + length]
        at += 3 + length
    raise VpdError("VPD-R has no RV checksum keyword")


def vpd_image(name: str, keywords: dict[str, str]) -> bytes:
    """A PCI VPD image with identifier `name` and these VPD-R keywords, checksummed (the inverse of
    `vpd_keywords`; the simulated sysfs writes it as a function's `vpd` file)."""
    ident = name.encode()
    out = bytearray([0x82, len(ident) & 0xFF, len(ident) >> 8]) + ident
    body = bytearray()
    for key, value in keywords.items():
        raw = value.encode()
        body += key.encode()[:2] + bytes([len(raw)]) + raw
    body += b"RV\x01"
    out += bytes([0x90]) + (len(body) + 1).to_bytes(2, "little") + body
    out.append(-sum(out) & 0xFF)
    out.append(0x78)
    return bytes(out)


def _shared_depth(a: Location, b: Location) -> int:
    """How many switches (from the root) two locations share."""
    if a.root != b.root:
        return 0
    depth = 0
    for mine, theirs in zip(a.switches, b.switches, strict=False):
        if mine != theirs:
            break
        depth += 1
    return depth


@dataclasses.dataclass(frozen=True)
class _Side:
    location: Location
    data_direct: bool = False  # a NIC placed at its Data Direct DMA function
    c2c_member: bool = False  # may join a numa:<n> group: a C2C GPU, or a ConnectX PF (not a BlueField) on C2C


def _locality(me: _Side, others: Iterable[_Side]) -> tuple[str, str]:
    """(path, group) of one device given the other kind's devices; ("", "") when none is near."""
    depth, data_direct, c2c_peer = 0, me.data_direct, False
    for other in others:
        shared = _shared_depth(me.location, other.location)
        if shared > depth:
            depth, data_direct = shared, me.data_direct or other.data_direct
        elif shared and shared == depth:
            data_direct = data_direct or other.data_direct
        c2c_peer = c2c_peer or (other.c2c_member and other.location.numa == me.location.numa)
    if depth:
        return (PATH_DATA_DIRECT if data_direct else PATH_SWITCH), f"sw:{me.location.switches[depth - 1]}"
    if me.c2c_member and me.location.numa is not None and c2c_peer:
        return PATH_C2C, f"numa:{me.location.numa}"
    return "", ""


def _is_connectx_pf(nic: Nic) -> bool:
    try:
        return int(nic.pci.vendor, 16) == MELLANOX_VENDOR and int(nic.pci.device, 16) in CONNECTX_PF_DEVICES
    except ValueError:
        return False


def _gpudirect_nic(nic: Nic) -> bool:
    """NICs GPUDirect RDMA can use: RDMA functions, and ConnectX PFs whose VFs carry the RDMA (vfio/DPDK)."""
    return nic.is_rdma or _is_connectx_pf(nic)


def annotate(topology: Topology) -> Topology:
    """The topology with `gpu_direct_path`/`gpu_direct_group` set on every GPU, NIC and VF."""
    nics = [nic for nic in topology.nics if _gpudirect_nic(nic)]
    gpu_sides = [_Side(gpu.location, c2c_member=gpu.location.c2c) for gpu in topology.gpus]

    def unit_side(nic: Nic) -> _Side:
        where = topology.unit_location(nic)
        at_dma = bool(nic.data_direct_function) and (not nic.vfs or topology.data_direct_vfs)
        return _Side(where, data_direct=at_dma, c2c_member=where.c2c and _is_connectx_pf(nic))

    nic_sides = [unit_side(nic) for nic in nics]
    gpus = []
    for gpu, side in zip(topology.gpus, gpu_sides, strict=True):
        path, group = _locality(side, nic_sides)
        gpus.append(dataclasses.replace(gpu, gpu_direct_path=path, gpu_direct_group=group))
    annotated = []
    for nic in topology.nics:
        if not _gpudirect_nic(nic):
            annotated.append(nic)
            continue
        own = topology.data_path(nic)
        path, group = _locality(_Side(own, bool(nic.data_direct_function), own.c2c and _is_connectx_pf(nic)),
                                gpu_sides)
        vf_path, vf_group = _locality(unit_side(nic), gpu_sides)
        vfs = tuple(dataclasses.replace(vf, gpu_direct_path=vf_path, gpu_direct_group=vf_group) for vf in nic.vfs)
        annotated.append(dataclasses.replace(nic, gpu_direct_path=path, gpu_direct_group=group, vfs=vfs))
    return dataclasses.replace(topology, gpus=tuple(gpus), nics=tuple(annotated))
