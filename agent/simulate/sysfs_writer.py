"""Write a profile as a sysfs tree in the Linux kernel's layout, so the real sysfs reader runs on it as is.

Layout, relative to the tree root (which plays `/sys`):

1. Root complexes are `devices/pci<dddd>:<bb>/` (with `pci_bus/<dddd>:<bb>/`); bridges and endpoints nest by
   real path: `devices/pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:00.0/...` is root complex / root port /
   switch upstream port / switch downstream port / ... Child buses are greater than the parent bridge's bus.
   A bridge with children has `pci_bus/<dddd>:<secondary>/`; `class/pci_bus/<dddd>:<bb>` links to each.
2. Every PCI function dir (bridges and VFs too) has `vendor` ("0x15b3\\n"), `device`, `class`
   ("0x020700\\n"), `subsystem_vendor`, `subsystem_device`, `numa_node` ("0\\n"; "-1\\n" when unknown),
   `max_link_speed` ("32.0 GT/s PCIe\\n"), `max_link_width` ("16\\n"), `current_link_speed`,
   `current_link_width`. A bound function has `driver` -> `../(...)/bus/pci/drivers/<name>`, and that dir
   links back to it by BDF. Bridges are class 0x060400 with driver `pcieport`.
3. `bus/pci/devices/<BDF>` -> `../../../devices/pci<dddd>:<bb>/.../<BDF>` for every function.
4. SR-IOV: a PF has `sriov_totalvfs`, `sriov_numvfs` and `virtfn<i>` -> `../<VF BDF>`; VF dirs are siblings
   of the PF dir with `physfn` -> `../<PF BDF>`. VF i has devfn = PF devfn + 1 + i on the PF's bus, its own
   model's ids and driver, and the PF's numa_node.
5. Netdevs: `<fn>/net/<ifname>/` with `operstate` ("up\\n"/"down\\n"), `carrier` ("1\\n"/"0\\n"),
   `type` ("32\\n" InfiniBand, "1\\n" Ethernet), `address`, `ifindex`, `device` -> `../../../<BDF>`;
   `class/net/<ifname>` links to it. `lo` is `devices/virtual/net/lo` (ifindex 1); PCI netdevs count from 2
   in RDMA order (PFs by bus id, then VFs). VF netdevs are `<PF netdev>v<i>`.
6. RDMA (models with `net.rdma`): `<fn>/infiniband/mlx5_<k>/` with `node_guid`, `sys_image_guid`,
   `node_type` ("1: CA\\n"), `fw_ver`, `device` -> `../../../<BDF>` and `ports/1/` with `state`
   ("4: ACTIVE\\n"), `phys_state` ("5: LinkUp\\n"), `link_layer` ("InfiniBand\\n"/"Ethernet\\n"), `rate`;
   `class/infiniband/mlx5_<k>` links to it. Char devices, each with `ibdev` ("mlx5_<k>\\n"), `dev` and
   `device`: `<fn>/infiniband_verbs/uverbs<k>/` (dev "231:<192+k>", the kernel's uverbs minors),
   `<fn>/infiniband_mad/umad<k>/` (dev "231:<k>", `port`) and `issm<k>/` (dev "231:<64+k>", `port`), linked
   from `class/infiniband_verbs/` and `class/infiniband_mad/`, which also hold the kernel's `abi_version`.
   k counts RDMA PFs in bus-id order, then VFs in PF order and VF index.
7. GPUs are plain functions (vendor 0x10de, class 0x0302xx, driver `nvidia`). Their UUIDs are not in sysfs:
   `Profile.gpu_uuids` holds them for the simulated NVML.

8. Health files: every non-VF function has `aer_dev_{correctable,fatal,nonfatal}` (all zero); every RDMA port
   has `counters/<name>` and `hw_counters/<name>` ("0\n") for the counters health reads. Inject a fault by
   writing one: `echo 1 > class/infiniband/mlx5_0/ports/1/counters/link_downed`, `echo 8 >
   bus/pci/devices/<gpu>/current_link_width`, or a TOTAL_ERR_FATAL line in `aer_dev_fatal`. A profile with
   GPUs and RDMA NICs has `module/nvidia_peermem/` (GPUDirect RDMA loaded; remove it to see the finding).

9. IOMMU groups (an IOMMU on, one group per function, numbered in tree order): `<fn>/iommu_group` ->
   `kernel/iommu_groups/<n>`, whose `devices/<BDF>` links back. A function bound to `vfio-pci` (a model with that
   driver, e.g. the VFs of profile `pcie-pairs-dpdk`) is opened through `/dev/vfio/<n>`; it has no netdev and no
   RDMA device, as a real vfio-bound VF.

10. VPD: a device with `vpd` in its profile has the binary `vpd` file (identifier string, VPD-R keywords, the
   checksum, the end tag), as drivers/pci/vpd.c serves it; write garbage there to see the Data Direct fallback.

A function with `link_up: false` reports netdev `down`, carrier 0 and port `1: DOWN`/`3: Disabled`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from agent.host.nic_sysfs import HW_COUNTERS, PORT_COUNTERS
from agent.simulate.profiles import Model, Profile, vf_bus_id
from agent.simulate.sysfs_tree import SysfsTree
from agent.topology.locality import vpd_image

# AER counter files as the kernel writes them (drivers/pci/pcie/aer.c aer_stats_attrs): one "<Name> <count>"
# line per named bit, then the TOTAL line. Correctable and uncorrectable bit names of current kernels.
AER_FILES = {
    "correctable": ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF",
                    "TOTAL_ERR_COR"),
    "fatal": ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
              "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
              "PoisonTLPBlocked", "TOTAL_ERR_FATAL"),
    "nonfatal": ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP",
                 "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked", "TLPBlockedErr",
                 "PoisonTLPBlocked", "TOTAL_ERR_NONFATAL"),
}
UVERBS_MAJOR = 231
UVERBS_BASE_MINOR = 192
ISSM_BASE_MINOR = 64
RDMA_PREFIX = "mlx5_"


@dataclass(frozen=True)
class SimFunction:
    """One PCI function the writer emits, VFs included, with the names the simulated kernel gives it."""

    bdf: str
    model: Model
    path: PurePosixPath  # from the tree root: devices/pci.../<bdf>
    numa_node: int | None
    netdev: str | None = None
    link_up: bool = True
    secondary_bus: str | None = None  # bridges with children: "dddd:bb"
    pf: str | None = None  # VFs: the PF's bus id
    vf_index: int | None = None
    vfs: tuple[str, ...] = ()  # PFs: their VFs' bus ids, in index order
    rdma_index: int | None = None  # k of mlx5_<k>, uverbs<k>, umad<k>, issm<k>
    ifindex: int | None = None
    vpd: bytes | None = None  # the `vpd` file's bytes

    @property
    def rdma(self) -> str | None:
        """RDMA device name, e.g. mlx5_3."""
        return None if self.rdma_index is None else f"{RDMA_PREFIX}{self.rdma_index}"


def functions(profile: Profile) -> tuple[SimFunction, ...]:
    """Every function of the profile in tree order, each PF followed by its VFs, with names assigned."""
    listed: list[SimFunction] = []
    for rc, chain, dev in profile.walk():
        parent = PurePosixPath("devices", rc.name, *(d.bdf for d in chain))
        vfs = tuple(vf_bus_id(dev.bdf, i) for i in range(dev.vfs))
        secondary = dev.children[0].bdf[:7] if dev.children else None
        vpd = vpd_image(dev.vpd[0], dict(dev.vpd[1])) if dev.vpd is not None else None
        listed.append(SimFunction(dev.bdf, dev.model, parent / dev.bdf, rc.numa_node, dev.netdev, dev.link_up,
                                  secondary, vfs=vfs, vpd=vpd))
        vf_model = dev.model.vf_model
        for i, vf in enumerate(vfs):
            assert vf_model is not None  # the loader only allows vfs on models with a vf_model
            netdev = f"{dev.netdev}v{i}" if dev.netdev and vf_model.net else None
            listed.append(SimFunction(vf, vf_model, parent / vf, rc.numa_node, netdev, dev.link_up,
                                      pf=dev.bdf, vf_index=i))
    pfs = sorted((f for f in listed if f.pf is None), key=lambda f: f.bdf)
    vf_order = [vf for pf in pfs for vf in listed if vf.pf == pf.bdf]
    rdma: dict[str, int] = {}
    ifindex: dict[str, int] = {}
    for f in [*pfs, *vf_order]:
        if f.model.net is not None and f.model.net.rdma:
            rdma[f.bdf] = len(rdma)
        if f.netdev is not None:
            ifindex[f.bdf] = len(ifindex) + 2
    return tuple(
replace(f, rdma_index=rdma.get(f.bdf), ifindex=ifindex.get(f.bdf)) for f in listed
    )


def _digest(profile: Profile, bdf: str) -> bytes:
    return hashlib.sha256(f"{profile.name}/{bdf}".encode()).digest()


def node_guid(profile: Profile, bdf: str) -> str:
    """The simulated RDMA node GUID of a function, e.g. `946d:ae03:00c1:27f4` (stable per profile and BDF)."""
    raw = bytes.fromhex("946dae03") + _digest(profile, bdf)[:4]
    return ":".join(raw[i : i + 2].hex() for i in range(0, 8, 2))


def mac_address(profile: Profile, bdf: str) -> str:
    """The simulated Ethernet MAC of a function (Mellanox OUI, stable per profile and BDF)."""
    return ":".join(f"{b:02x}" for b in bytes.fromhex("0c42a1") + _digest(profile, bdf)[4:7])


def _ib_address(guid: str) -> str:
    raw = bytes.fromhex("00001087fe80000000000000") + bytes.fromhex(guid.replace(":", ""))
    return ":".join(f"{b:02x}" for b in raw)


def profile_tree(profile: Profile) -> SysfsTree:
    """The profile's sysfs tree (see the module docstring for the layout)."""
    tree = SysfsTree()
    for rc in profile.root_complexes:
        bus = rc.name[3:]
        tree.add_dir(f"devices/{rc.name}/pci_bus/{bus}")
        tree.add_symlink_to(f"class/pci_bus/{bus}", f"devices/{rc.name}/pci_bus/{bus}")
    lo = "devices/virtual/net/lo"
    for name, text in (("operstate", "unknown"), ("carrier", "1"), ("type", "772"), ("ifindex", "1"),
                       ("address", "00:00:00:00:00:00")):
        tree.add_file(f"{lo}/{name}", f"{text}\n")
    tree.add_symlink_to("class/net/lo", lo)
    tree.add_file("class/infiniband_verbs/abi_version", "6\n")
    tree.add_file("class/infiniband_mad/abi_version", "5\n")
    tree.add_dir("bus/pci/drivers")
    listed = functions(profile)
    for group, f in enumerate(listed):
        _write_function(tree, profile, f)
        tree.add_symlink_to(f"kernel/iommu_groups/{group}/devices/{f.bdf}", f.path)
        tree.add_symlink_to(f.path / "iommu_group", f"kernel/iommu_groups/{group}")
    if any(f.model.is_gpu for f in listed) and any(f.rdma_index is not None for f in listed):
        tree.add_file("module/nvidia_peermem/initstate", "live\n")  # GPUDirect RDMA, as the GPU operator loads it
    return tree


def _config_space(m: Model) -> bytes:
    """The 256-byte PCI configuration space root reads: ids, class, and a capability list holding one power
    management capability (no vendor-specific one: a bare-metal GPU, not a vGPU)."""
    space = bytearray(256)
    space[0:2], space[2:4] = int(m.vendor, 16).to_bytes(2, "little"), int(m.device, 16).to_bytes(2, "little")
    space[6] = 0x10  # status: capability list present
    space[9:12] = int(m.pci_class, 16).to_bytes(3, "little")  # prog-if, subclass, class
    space[0x34] = 0x60
    space[0x60:0x62] = bytes((0x01, 0x00))  # PM capability, end of list
    return bytes(space)


def _write_function(tree: SysfsTree, profile: Profile, f: SimFunction) -> None:
    base, m = f.path, f.model
    numa = "-1" if f.numa_node is None else str(f.numa_node)
    for name, text in (
        ("vendor", m.vendor), ("device", m.device), ("class", m.pci_class),
        ("subsystem_vendor", m.subsystem_vendor), ("subsystem_device", m.subsystem_device),
        ("numa_node", numa), ("max_link_speed", m.link_speed), ("max_link_width", m.link_width),
        ("current_link_speed", m.current_link_speed), ("current_link_width", m.current_link_width),
    ):
        tree.add_file(base / name, f"{text}\n")
    tree.add_file(base / "config", _config_space(m))
    tree.add_symlink_to(f"bus/pci/devices/{f.bdf}", base)
    if f.vpd is not None:
        tree.add_file(base / "vpd", f.vpd)
    if f.pf is None:
        for kind, lines in AER_FILES.items():
            tree.add_file(base / f"aer_dev_{kind}", "".join(f"{name} 0\n" for name in lines))
    if m.driver:
        tree.add_dir(f"bus/pci/drivers/{m.driver}")
        tree.add_symlink_to(base / "driver", f"bus/pci/drivers/{m.driver}")
        tree.add_symlink_to(f"bus/pci/drivers/{m.driver}/{f.bdf}", base)
    if f.secondary_bus:
        tree.add_dir(base / "pci_bus" / f.secondary_bus)
        tree.add_symlink_to(f"class/pci_bus/{f.secondary_bus}", base / "pci_bus" / f.secondary_bus)
    if m.vf_model is not None:
        tree.add_file(base / "sriov_totalvfs", f"{m.sriov_totalvfs}\n")
        tree.add_file(base / "sriov_numvfs", f"{len(f.vfs)}\n")
        for i, vf in enumerate(f.vfs):
            tree.add_symlink(base / f"virtfn{i}", f"../{vf}")
    if f.pf is not None:
        tree.add_symlink(base / "physfn", f"../{f.pf}")
    guid = node_guid(profile, f.bdf)
    if f.netdev is not None and m.net is not None:
        infiniband = m.net.link_layer == "InfiniBand"
        net = base / "net" / f.netdev
        for name, text in (
            ("operstate", "up" if f.link_up else "down"), ("carrier", "1" if f.link_up else "0"),
            ("type", "32" if infiniband else "1"), ("ifindex", str(f.ifindex)),
            ("address", _ib_address(guid) if infiniband else mac_address(profile, f.bdf)),
        ):
            tree.add_file(net / name, f"{text}\n")
        tree.add_symlink(net / "device", f"../../../{f.bdf}")
        tree.add_symlink_to(f"class/net/{f.netdev}", net)
    if f.rdma_index is not None and m.net is not None:
        _write_rdma(tree, f, guid, m)


def _write_rdma(tree: SysfsTree, f: SimFunction, guid: str, m: Model) -> None:
    assert m.net is not None and f.rdma is not None
    k, ibdev, base = f.rdma_index, f.rdma, f.path
    dev = base / "infiniband" / ibdev
    for name, text in (("node_guid", guid), ("sys_image_guid", guid), ("node_type", "1: CA"),
                       ("fw_ver", m.net.fw_ver), ("node_desc", f"sim {ibdev}")):
        tree.add_file(dev / name, f"{text}\n")
    tree.add_symlink(dev / "device", f"../../../{f.bdf}")
    up = f.link_up
    for name, text in (("state", "4: ACTIVE" if up else "1: DOWN"), ("phys_state", "5: LinkUp" if up else
                       "3: Disabled"), ("link_layer", m.net.link_layer), ("rate", m.net.rate)):
        tree.add_file(dev / "ports" / "1" / name, f"{text}\n")
    for sub, names in (("counters", PORT_COUNTERS), ("hw_counters", HW_COUNTERS)):
        for name in names:
            tree.add_file(dev / "ports" / "1" / sub / name, "0\n")
    tree.add_symlink_to(f"class/infiniband/{ibdev}", dev)
    assert k is not None
    for cls, node, minor in (
        ("infiniband_verbs", f"uverbs{k}", UVERBS_BASE_MINOR + k),
        ("infiniband_mad", f"umad{k}", k),
        ("infiniband_mad", f"issm{k}", ISSM_BASE_MINOR + k),
    ):
        char = base / cls / node
        tree.add_file(char / "ibdev", f"{ibdev}\n")
        tree.add_file(char / "dev", f"{UVERBS_MAJOR}:{minor}\n")
        if cls == "infiniband_mad":
            tree.add_file(char / "port", "1\n")
        tree.add_symlink(char / "device", f"../../../{f.bdf}")
        tree.add_symlink_to(f"class/{cls}/{node}", char)


def write_sysfs(profile: Profile, out: Path) -> None:
    """Write the profile's sysfs tree under `out` (created when missing; must not already hold the tree)."""
    profile_tree(profile).write(out)
