"""The written sysfs trees have the kernel's layout, checked with plain os/pathlib calls."""

from __future__ import annotations

import itertools
import os
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from agent.simulate.profiles import load_profile, load_profile_file
from agent.simulate.sysfs_tree import Dir, File, Symlink, SysfsTree
from agent.simulate.sysfs_writer import functions, profile_tree, write_sysfs
from agent.topology.model import Level, Location

PROFILES = ["dgx-h100", "dgx-h100-mig", "pcie-pairs", "pcie-pairs-dpdk", "vm-flat"]
PCI_FILES = ["vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node",
             "max_link_speed", "max_link_width", "current_link_speed", "current_link_width"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("sysfs")
    for name in PROFILES:
        write_sysfs(load_profile(name), base / name)
    return {name: base / name for name in PROFILES}


def read(path: Path) -> str:
    return path.read_text().strip()


def pci_functions(root: Path) -> dict[str, Path]:
    """bus/pci/devices/<BDF> resolved, keyed by BDF."""
    return {link.name: link.resolve() for link in (root / "bus/pci/devices").iterdir()}


def by_class(root: Path, prefix: str) -> dict[str, Path]:
    return {bdf: p for bdf, p in pci_functions(root).items() if read(p / "class").startswith(prefix)}


def pfs(root: Path, prefix: str = "0x02") -> dict[str, Path]:
    return {bdf: p for bdf, p in by_class(root, prefix).items() if not (p / "physfn").exists()}


def location(root: Path, fn: Path) -> Location:
    """NCCL-style location from a resolved path: root complex plus each switch's upstream port."""
    if (fn / "physfn").exists():
        fn = (fn / "physfn").resolve()
    parts = fn.relative_to(root / "devices").parts
    bridges = parts[1:-1]  # root port, then (USP, DSP) per switch
    return Location(parts[0], tuple(bridges[1::2]), int(read(fn / "numa_node")))


def level(root: Path, a: Path, b: Path) -> Level:
    return location(root, a).level_to(location(root, b))


@pytest.mark.parametrize("name", PROFILES)
def test_every_pci_link_is_relative_and_resolves_to_a_function(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    links = list((root / "bus/pci/devices").iterdir())
    assert links
    for link in links:
        target = os.readlink(link)
        assert target.startswith("../../../devices/pci"), target
        fn = link.resolve()
        assert fn.is_dir()
        assert fn.name == link.name
        for file in PCI_FILES:
            assert (fn / file).is_file(), fn / file
        assert read(fn / "vendor").startswith("0x")
        assert read(fn / "numa_node") in {"0", "1"}
        parts = fn.relative_to(root / "devices").parts
        assert parts[0] == f"pci{parts[1][:7]}"  # the root complex holds the first function's bus
        for parent, child in itertools.pairwise(parts[1:]):
            assert child[:4] == parent[:4]
            assert int(child[5:7], 16) > int(parent[5:7], 16)
        for i in range(1, len(parts) - 1):
            bridge = root / "devices" / Path(*parts[: i + 1])
            assert read(bridge / "class") == "0x060400"


@pytest.mark.parametrize("name", PROFILES)
def test_drivers_are_relative_links_into_bus_pci_drivers(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    drivers: Counter[str] = Counter()
    for bdf, fn in pci_functions(root).items():
        assert not os.readlink(fn / "driver").startswith("/")
        driver = (fn / "driver").resolve()
        assert driver.parent == (root / "bus/pci/drivers").resolve()
        assert (driver / bdf).resolve() == fn
        drivers[driver.name] += 1
    assert {"nvidia", "mlx5_core"} <= set(drivers)


@pytest.mark.parametrize("name", PROFILES)
def test_sriov_links_are_consistent(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    for bdf, fn in pci_functions(root).items():
        virtfns = sorted(fn.glob("virtfn*"), key=lambda p: int(p.name[6:]))
        if (fn / "sriov_totalvfs").exists():
            assert int(read(fn / "sriov_numvfs")) == len(virtfns) <= int(read(fn / "sriov_totalvfs"))
        else:
            assert not virtfns
        for i, link in enumerate(virtfns):
            assert link.name == f"virtfn{i}"
            vf = link.resolve()
            assert os.readlink(link) == f"../{vf.name}"
            assert vf.parent == fn.parent  # VFs are siblings of their PF
            assert (vf / "physfn").resolve() == fn
            assert read(vf / "numa_node") == read(fn / "numa_node")
            devfn = lambda b: int(b[8:10], 16) << 3 | int(b[11])  # noqa: E731
            assert devfn(vf.name) == devfn(bdf) + 1 + i
            assert vf.name[:7] == bdf[:7]
        if (fn / "physfn").exists():
            pf = (fn / "physfn").resolve()
            assert os.readlink(fn / "physfn") == f"../{pf.name}"
            assert any(link.resolve() == fn for link in pf.glob("virtfn*"))


@pytest.mark.parametrize("name", PROFILES)
def test_rdma_and_char_devices_agree(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    ibdevs = {p.name: p.resolve() for p in (root / "class/infiniband").iterdir()}
    assert ibdevs
    for ibdev, path in ibdevs.items():
        assert path.parent.name == "infiniband"
        assert (path / "device").resolve() == path.parent.parent
        assert read(path / "node_type") == "1: CA"
        assert len(read(path / "node_guid").split(":")) == 4
        assert read(path / "ports/1/state") == "4: ACTIVE"
        assert read(path / "ports/1/phys_state") == "5: LinkUp"
        assert read(path / "ports/1/link_layer") in {"InfiniBand", "Ethernet"}
        assert "Gb/sec" in read(path / "ports/1/rate")
        k = int(ibdev.removeprefix("mlx5_"))
        fn = path.parent.parent
        for cls, node, minor in (("infiniband_verbs", f"uverbs{k}", 192 + k),
                                 ("infiniband_mad", f"umad{k}", k), ("infiniband_mad", f"issm{k}", 64 + k)):
            char = (root / "class" / cls / node).resolve()
            assert char.parent == fn / cls
            assert read(char / "ibdev") == ibdev
            assert read(char / "dev") == f"231:{minor}"
            assert (char / "device").resolve() == fn
    for cls, prefixes in (("infiniband_verbs", ("uverbs",)), ("infiniband_mad", ("umad", "issm"))):
        nodes = [p for p in (root / "class" / cls).iterdir() if p.name.startswith(prefixes)]
        assert len(nodes) == len(ibdevs) * len(prefixes)
        for node in nodes:
            assert read(node / "ibdev") in ibdevs
        assert (root / "class" / cls / "abi_version").is_file()


@pytest.mark.parametrize("name", PROFILES)
def test_rdma_names_count_pfs_by_bus_id_then_vfs(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    functions_ = pci_functions(root)
    rdma_pfs = sorted(bdf for bdf, p in pfs(root).items() if (p / "infiniband").is_dir())
    order = list(rdma_pfs)
    for pf in rdma_pfs:
        fn = functions_[pf]
        order += [link.resolve().name for link in sorted(fn.glob("virtfn*"), key=lambda p: int(p.name[6:]))
                  if (link.resolve() / "infiniband").is_dir()]  # vfio-bound VFs have no RDMA device
    for k, bdf in enumerate(order):
        fn = functions_[bdf]
        assert [p.name for p in (fn / "infiniband").iterdir()] == [f"mlx5_{k}"]
    assert len(order) == len(list((root / "class/infiniband").iterdir()))


@pytest.mark.parametrize("name", PROFILES)
def test_netdevs(trees: dict[str, Path], name: str) -> None:
    root = trees[name]
    ifindexes = []
    for link in (root / "class/net").iterdir():
        assert not os.readlink(link).startswith("/")
        net = link.resolve()
        assert net.name == link.name
        assert read(net / "operstate") in {"up", "unknown"}
        assert read(net / "carrier") == "1"
        ifindexes.append(int(read(net / "ifindex")))
        if link.name == "lo":
            continue
        fn = net.parent.parent
        assert net.parent.name == "net"
        assert (net / "device").resolve() == fn
        ib = fn / "infiniband"
        if ib.is_dir():
            layer = read(next(ib.iterdir()) / "ports/1/link_layer")
            assert read(net / "type") == {"InfiniBand": "32", "Ethernet": "1"}[layer]
        expected_octets = 20 if read(net / "type") == "32" else 6
        assert len(read(net / "address").split(":")) == expected_octets
    assert sorted(ifindexes) == list(range(1, len(ifindexes) + 1))


def test_dgx_h100_inventory(trees: dict[str, Path]) -> None:
    root = trees["dgx-h100"]
    gpus = by_class(root, "0x0302")
    assert len(gpus) == 8
    assert all(read(p / "vendor") == "0x10de" and read(p / "device") == "0x2330" for p in gpus.values())
    assert all((p / "driver").resolve().name == "nvidia" for p in gpus.values())
    rdma = {bdf: p for bdf, p in pfs(root).items() if (p / "infiniband").is_dir()}
    assert len(rdma) == 8
    for fn in rdma.values():
        ids = (read(fn / "class"), read(fn / "vendor"), read(fn / "device"))
        assert ids == ("0x020700", "0x15b3", "0x1021")
        assert read(fn / "sriov_numvfs") == "8"
        assert next((fn / "net").iterdir()).name.startswith("ibp")
        vfs = [link.resolve() for link in fn.glob("virtfn*")]
        assert len(vfs) == 8
        for vf in vfs:
            assert (read(vf / "device"), read(vf / "class")) == ("0x101e", "0x020700")
            assert len(list((vf / "infiniband").iterdir())) == 1
            assert len(list((vf / "infiniband_verbs").iterdir())) == 1
            assert read(next((vf / "net").iterdir()) / "type") == "32"
    ether = {bdf: p for bdf, p in pfs(root).items() if bdf not in rdma}
    assert len(ether) == 2
    for fn in ether.values():
        assert read(fn / "class") == "0x020000"
        assert (fn / "driver").resolve().name == "mlx5_core"
        assert not (fn / "infiniband").exists()
        assert not (fn / "sriov_totalvfs").exists()
        assert read(next((fn / "net").iterdir()) / "type") == "1"
    assert sorted(read(p / "numa_node") for p in ether.values()) == ["0", "1"]
    assert Counter(read(p / "numa_node") for p in gpus.values()) == {"0": 4, "1": 4}
    assert (root / "class/net/ibp24s0v3").is_dir()


def test_dgx_h100_each_gpu_shares_its_lower_switch_with_one_rdma_nic(trees: dict[str, Path]) -> None:
    root = trees["dgx-h100"]
    gpus, nics = by_class(root, "0x0302"), {b: p for b, p in pfs(root).items() if (p / "infiniband").is_dir()}
    for gpu in gpus.values():
        assert len(gpu.relative_to(root / "devices").parts) == 7  # rc / rp / usp / dsp / usp / dsp / gpu
        mates = [nic for nic in nics.values() if nic.parents[1] == gpu.parents[1]]
        assert len(mates) == 1
        levels = Counter(level(root, gpu, nic).name for nic in nics.values())
        assert levels == {"PIX": 1, "PXB": 1, "NODE": 2, "SYS": 4}
        for ether in (p for b, p in pfs(root).items() if b not in nics):
            assert level(root, gpu, ether) in {Level.NODE, Level.SYS}
    roots = Counter(gpu.relative_to(root / "devices").parts[0] for gpu in gpus.values())
    assert len(roots) == 4
    assert set(roots.values()) == {2}


def test_pcie_pairs(trees: dict[str, Path]) -> None:
    root = trees["pcie-pairs"]
    gpus = by_class(root, "0x0302")
    nics = pfs(root)
    assert (len(gpus), len(nics)) == (8, 4)
    vfs = [bdf for bdf, p in by_class(root, "0x02").items() if (p / "physfn").exists()]
    assert len(vfs) == 16
    for fn in nics.values():
        ids = (read(fn / "class"), read(fn / "device"), read(fn / "sriov_numvfs"))
        assert ids == ("0x020000", "0x1017", "4")
        assert read(next((fn / "infiniband").iterdir()) / "ports/1/link_layer") == "Ethernet"
        assert read(next((fn / "net").iterdir()) / "type") == "1"
        assert len([g for g in gpus.values() if level(root, g, fn) == Level.PIX]) == 2
    assert (root / "class/net/enp24s0f0v1/device").resolve().name == "0000:18:00.2"
    assert read(root / "bus/pci/devices/0000:18:00.2/device") == "0x1018"
    levels = {level(root, g, n) for g in gpus.values() for n in nics.values()}
    assert levels == {Level.PIX, Level.PHB, Level.SYS}


def test_vm_flat(trees: dict[str, Path]) -> None:
    root = trees["vm-flat"]
    profile = load_profile("vm-flat")
    functions_ = pci_functions(root)
    assert len(functions_) == 16
    for bdf, fn in functions_.items():
        assert fn.relative_to(root / "devices").parts == (f"pci{bdf[:7]}", bdf)
        assert not any(fn.glob("sriov_*")) and not (fn / "physfn").exists()
        n = int(bdf[:4], 16) & 0xFF
        assert read(fn / "numa_node") == ("0" if n <= 4 else "1")
    for n in range(1, 9):
        gpu, nic = functions_[f"{n:04x}:00:00.0"], functions_[f"{0x100 + n:04x}:00:00.0"]
        assert read(gpu / "class") == "0x030200"
        assert [p.name for p in (nic / "infiniband").iterdir()] == [f"mlx5_{n - 1}"]
        assert level(root, gpu, nic) == Level.NODE  # sysfs cannot see the pairing; the XML restores it
    assert profile.topology_xml is not None
    for net in ET.parse(profile.topology_xml).getroot().iter("net"):  # noqa: S314 (our own package data)
        guid = read(root / "class/infiniband" / net.get("name", "") / "node_guid")
        assert net.get("guid") == "0x" + guid.replace(":", "")


def test_link_down_function(tmp_path: Path) -> None:
    source = load_profile("vm-flat")
    text = Path(source.topology_xml or "").with_suffix(".json").read_text()
    text = text.replace('"netdev": "ib3"', '"netdev": "ib3", "link_up": false')
    (tmp_path / "down.json").write_text(text.replace('"topology_xml": "vm-flat.xml",', ""))
    write_sysfs(load_profile_file(tmp_path / "down.json"), tmp_path / "sys")
    net, ib = tmp_path / "sys/class/net/ib3", tmp_path / "sys/class/infiniband/mlx5_3/ports/1"
    assert (read(net / "operstate"), read(net / "carrier")) == ("down", "0")
    assert (read(ib / "state"), read(ib / "phys_state")) == ("1: DOWN", "3: Disabled")
    assert read(tmp_path / "sys/class/net/ib2/operstate") == "up"


def test_functions_and_tree_are_deterministic() -> None:
    profile = load_profile("dgx-h100")
    assert list(profile_tree(profile).items()) == list(load_and_tree("dgx-h100").items())
    listed = functions(profile)
    assert len(listed) == len({f.bdf for f in listed})
    assert [f.rdma for f in listed if f.bdf == "0000:18:01.0"] == ["mlx5_15"]


def load_and_tree(name: str) -> SysfsTree:
    return profile_tree(load_profile(name))


def test_write_sysfs_into_existing_empty_dir_but_not_twice(tmp_path: Path) -> None:
    profile = load_profile("vm-flat")
    write_sysfs(profile, tmp_path)
    assert (tmp_path / "bus/pci/devices").is_dir()
    with pytest.raises(FileExistsError):
        write_sysfs(profile, tmp_path)


# ---- SysfsTree ---------------------------------------------------------------------------------------------


def test_tree_builds_dirs_files_and_relative_links(tmp_path: Path) -> None:
    tree = SysfsTree()
    tree.add_file("devices/pci0000:00/0000:00:01.0/vendor", "0x8086\n")
    tree.add_dir("devices/pci0000:00/0000:00:01.0/empty")
    tree.add_symlink_to("bus/pci/devices/0000:00:01.0", "devices/pci0000:00/0000:00:01.0")
    tree.add_symlink("class/net/ghost", "../../devices/nowhere")
    tree.add_file("garbage", b"\xff\xfe")
    assert isinstance(tree.get("devices"), Dir)
    assert tree.get("garbage") == File(b"\xff\xfe")
    assert tree.get("bus/pci/devices/0000:00:01.0") == Symlink("../../../devices/pci0000:00/0000:00:01.0")
    assert "devices/pci0000:00" in tree
    assert tree.read("devices/pci0000:00/0000:00:01.0/vendor") == "0x8086\n"
    tree.write(tmp_path)
    assert read(tmp_path / "bus/pci/devices/0000:00:01.0/vendor") == "0x8086"
    assert (tmp_path / "devices/pci0000:00/0000:00:01.0/empty").is_dir()
    ghost = tmp_path / "class/net/ghost"
    assert ghost.is_symlink() and not ghost.exists()
    assert (tmp_path / "garbage").read_bytes() == b"\xff\xfe"


def test_tree_replace_and_remove() -> None:
    tree = SysfsTree()
    tree.add_file("a/b/c", "1")
    tree.add_file("a/b/c", "2")
    assert tree.read("a/b/c") == "2"
    tree.add_symlink("a/b/c", "elsewhere")
    assert tree.get("a/b/c") == Symlink("elsewhere")
    tree.add_file("a/b/d")
    tree.remove("a/b")
    assert "a/b/c" not in tree and "a/b/d" not in tree and "a/b" not in tree
    assert "a" in tree
    with pytest.raises(KeyError):
        tree.remove("a/b")
    assert [str(p) for p, _ in tree.items()] == ["a"]


@pytest.mark.parametrize("path", ["/abs", "../out", "a/../../b", ".", ""])
def test_tree_rejects_paths_outside(path: str) -> None:
    with pytest.raises(ValueError, match="relative"):
        SysfsTree().add_file(path, "x")


def test_tree_conflicts() -> None:
    tree = SysfsTree()
    tree.add_file("f", "x")
    with pytest.raises(ValueError, match="not a directory"):
        tree.add_file("f/g", "y")
    with pytest.raises(ValueError, match="not a directory"):
        tree.add_dir("f")
    tree.add_dir("d")
    with pytest.raises(ValueError, match="is a directory"):
        tree.add_file("d", "y")
    with pytest.raises(ValueError, match="empty"):
        tree.add_symlink("l", "")
    with pytest.raises(KeyError):
        tree.read("d")


def test_tests_can_break_a_profile_tree(tmp_path: Path) -> None:
    profile = load_profile("pcie-pairs")
    tree = profile_tree(profile)
    pf = next(f.path for f in functions(profile) if f.bdf == "0000:18:00.0")
    assert pf.parts[0] == "devices"
    tree.remove(pf / "infiniband")
    tree.add_file(pf / "class", "not hex\n")
    tree.add_symlink("bus/pci/devices/0000:99:00.0", "../../../devices/pci0000:99/0000:99:00.0")
    tree.write(tmp_path)
    assert read(tmp_path / "bus/pci/devices/0000:18:00.0/class") == "not hex"
    assert not (tmp_path / "bus/pci/devices/0000:99:00.0").exists()
    assert not (tmp_path / "class/infiniband/mlx5_0").exists()  # now dangling
