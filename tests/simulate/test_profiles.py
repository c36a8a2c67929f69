"""Built-in profiles load, carry stable GPU UUIDs and the VM's NCCL XML; broken profile files fail clearly."""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.host.busid import normalize_bus_id
from agent.simulate.profiles import (
    PROFILE_DIR,
    ProfileError,
    UnknownProfileError,
    list_profiles,
    load_profile,
    load_profile_file,
    vf_bus_id,
)

BUILT_IN = ["dgx-h100", "dgx-h100-mig", "pcie-pairs", "pcie-pairs-dpdk", "vm-flat"]


def test_list_profiles_names_the_built_ins() -> None:
    names = list_profiles()
    assert set(BUILT_IN) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("name", ["no-such-node", "../profiles/dgx-h100", "", "DGX-H100"])
def test_unknown_profile_lists_the_known_names(name: str) -> None:
    with pytest.raises(UnknownProfileError) as info:
        load_profile(name)
    assert isinstance(info.value, ValueError)
    for known in BUILT_IN:
        assert known in str(info.value)


@pytest.mark.parametrize("name", BUILT_IN)
def test_profiles_load_with_eight_stable_gpu_uuids(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    assert profile.description
    assert len(profile.gpu_uuids) == 8
    assert list(profile.gpu_uuids) == sorted(profile.gpu_uuids)
    for bus_id, gpu_uuid in profile.gpu_uuids.items():
        assert normalize_bus_id(bus_id) == bus_id
        assert gpu_uuid.startswith("GPU-")
    assert len(set(profile.gpu_uuids.values())) == 8
    assert load_profile(name).gpu_uuids == profile.gpu_uuids


def test_uuids_differ_between_profiles() -> None:
    seen = [u for name in BUILT_IN for u in load_profile(name).gpu_uuids.values()]
    assert len(seen) == len(set(seen))


def test_only_vm_flat_has_a_topology_xml() -> None:
    assert load_profile("dgx-h100").topology_xml is None
    assert load_profile("pcie-pairs").topology_xml is None
    xml = load_profile("vm-flat").topology_xml
    assert xml is not None
    assert xml.is_file()
    assert xml.name == "vm-flat.xml"


@pytest.mark.parametrize("name", ["gb200-cx7", "gb300-cx8", "hgx-b300-cx8"])
def test_hardware_stand_ins_name_their_sources(name: str) -> None:
    """Each names a public capture for its layout, and says which values are synthetic or inferred."""
    load_profile(name)  # the schema accepts them
    sources = json.loads((PROFILE_DIR / f"{name}.json").read_text())["sources"]
    assert any("@" in source or "#" in source or "docs.nvidia.com" in source for source in sources.values())
    assert any(source.startswith(("synthetic", "[inference]")) for source in sources.values())


def test_vm_flat_xml_pairs_gpu_n_with_nic_n_under_synthetic_bridges() -> None:
    path = load_profile("vm-flat").topology_xml
    assert path is not None
    system = ET.parse(path).getroot()  # noqa: S314 (our own package data)
    assert system.tag == "system"
    assert system.get("version") == "1"
    cpus = system.findall("cpu")
    assert [c.get("numaid") for c in cpus] == ["0", "1"]
    for cpu in cpus:
        assert (cpu.get("arch"), cpu.get("vendor"), cpu.get("familyid"), cpu.get("modelid")) == (
            "x86_64", "GenuineIntel", "6", "143")
        assert cpu.get("affinity")
    for cpu_index, cpu in enumerate(cpus):
        bridges = cpu.findall("pci")
        numbers = [int(b.get("busid", "")[8:10]) for b in bridges]
        assert numbers == list(range(1 + 4 * cpu_index, 5 + 4 * cpu_index))
        for n, bridge in zip(numbers, bridges, strict=True):
            assert bridge.get("busid") == f"ffff:ff:{n:02x}.0"
            assert bridge.get("class") == "0x060400"
            assert bridge.get("link_speed") == "32.0 GT/s PCIe"
            assert bridge.get("link_width") == "16"
            assert bridge.get("vendor") == "0x0000"
            gpu, nic = bridge.findall("pci")
            assert (gpu.get("busid"), gpu.get("class")) == (f"{n:04x}:00:00.0", "0x030200")
            assert (nic.get("busid"), nic.get("class")) == (f"{0x100 + n:04x}:00:00.0", "0x020700")
            net = nic.find("nic/net")
            assert net is not None
            expected = (f"mlx5_{n - 1}", str(n - 1), "400000")
            assert (net.get("name"), net.get("dev"), net.get("speed")) == expected
            assert net.get("gdr") == "1"
            assert net.get("guid", "").startswith("0x")


def test_vm_flat_xml_bus_ids_match_the_profile() -> None:
    profile = load_profile("vm-flat")
    assert profile.topology_xml is not None
    system = ET.parse(profile.topology_xml).getroot()  # noqa: S314
    xml_ids = {p.get("busid") for p in system.iter("pci") if not p.get("busid", "").startswith("ffff:")}
    listed = {dev.bdf for _, _, dev in profile.walk()}
    assert xml_ids == listed


def test_vf_bus_ids_follow_offset_one_stride_one() -> None:
    assert [vf_bus_id("0000:18:00.0", i) for i in range(8)] == [
        "0000:18:00.1", "0000:18:00.2", "0000:18:00.3", "0000:18:00.4",
        "0000:18:00.5", "0000:18:00.6", "0000:18:00.7", "0000:18:01.0"]
    assert vf_bus_id("0000:3b:00.1", 0) == "0000:3b:00.2"
    assert vf_bus_id("0000:18:1f.6", 0) == "0000:18:1f.7"
    with pytest.raises(ValueError, match="does not fit"):
        vf_bus_id("0000:18:1f.6", 1)


def test_walk_yields_ancestors_top_down() -> None:
    profile = load_profile("dgx-h100")
    chains = {dev.bdf: (rc.name, [d.bdf for d in chain]) for rc, chain, dev in profile.walk()}
    assert chains["0000:1b:00.0"] == (
        "pci0000:10", ["0000:10:01.0", "0000:11:00.0", "0000:12:00.0", "0000:13:00.0", "0000:14:01.0"])


# ---- broken profile files --------------------------------------------------------------------------------

_MINIMAL: dict[str, Any] = {
    "name": "tiny",
    "description": "one switch, one GPU, one NIC",
    "models": {
        "port": {"vendor": "0x8086", "device": "0x1234", "class": "0x060400", "driver": "pcieport"},
        "gpu": {"vendor": "0x10de", "device": "0x2330", "class": "0x030200", "driver": "nvidia"},
        "nic": {"vendor": "0x15b3", "device": "0x1021", "class": "0x020700", "driver": "mlx5_core",
                "net": {"link_layer": "InfiniBand", "rdma": True}, "vf_model": "vf", "sriov_totalvfs": 4},
        "vf": {"vendor": "0x15b3", "device": "0x101e", "class": "0x020700",
               "net": {"link_layer": "InfiniBand", "rdma": True}},
    },
    "root_complexes": [{"root": "pci0000:00", "numa_node": None, "children": [
        {"bdf": "0000:00:01.0", "model": "port", "children": [
            {"bdf": "0000:01:00.0", "model": "gpu"},
            {"bdf": "0000:01:01.0", "model": "nic", "netdev": "ibp1s1", "vfs": 2}]}]}],
}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def _port(d: dict[str, Any]) -> dict[str, Any]:
    return d["root_complexes"][0]["children"][0]


def test_minimal_profile_loads(tmp_path: Path) -> None:
    profile = load_profile_file(_write(tmp_path, _MINIMAL), expect_name="tiny")
    assert profile.root_complexes[0].numa_node is None
    assert list(profile.gpu_uuids) == ["0000:01:00.0"]
    nic = profile.root_complexes[0].children[0].children[1]
    assert (nic.vfs, nic.netdev, nic.model.vf_model and nic.model.vf_model.device) == (2, "ibp1s1", "0x101e")
    assert nic.link_up


def _set(*keys: str | int, value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        target: Any = d
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return mutate


def _drop(*keys: str | int) -> Callable[[dict[str, Any]], None]:
    def mutate(d: dict[str, Any]) -> None:
        target: Any = d
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return mutate


def _add_child(child: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: _port(d)["children"].append(child)


def _add_root_child(child: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["root_complexes"][0]["children"].append(child)


def _second_root(rc: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["root_complexes"].append(rc)


RC0 = ("root_complexes", 0)
PORT = (*RC0, "children", 0)
GPU = (*PORT, "children", 0)
NIC = (*PORT, "children", 1)

BROKEN = {
    "missing description": (_drop("description"), "missing description"),
    "unknown top key": (_set("colour", value="red"), "unknown key(s) colour"),
    "empty source": (_set("sources", value={"bus ids": " "}), "sources.bus ids"),
    "name mismatch": (_set("name", value="other"), "does not match the file name"),
    "bad vendor": (_set("models", "gpu", "vendor", value="10de"), "models.gpu.vendor"),
    "uppercase class": (_set("models", "gpu", "class", value="0x0302AB"), "models.gpu.class"),
    "unknown model key": (_set("models", "gpu", "colour", value=1), "models.gpu"),
    "bad link layer": (_set("models", "nic", "net", "link_layer", value="Ether"), "InfiniBand or Ethernet"),
    "rdma not bool": (_set("models", "nic", "net", "rdma", value="yes"), "models.nic.net.rdma"),
    "missing vf model": (_set("models", "nic", "vf_model", value="nope"), "no model named 'nope'"),
    "vf model is a bridge": (_set("models", "nic", "vf_model", value="port"), "cannot be a VF model"),
    "link width not int": (_set("models", "gpu", "link_width", value="16"), "models.gpu.link_width"),
    "negative link width": (_set("models", "gpu", "link_width", value=-1), "must not be negative"),
    "root complexes not a list": (_set("root_complexes", value={}), "root_complexes: expected list"),
    "bad root name": (_set(*RC0, "root", value="pci0:0"), "pciDDDD:BB"),
    "negative numa": (_set(*RC0, "numa_node", value=-1), "numa_node"),
    "bool numa": (_set(*RC0, "numa_node", value=True), "numa_node"),
    "children not a list": (_set(*RC0, "children", value={}), "expected list"),
    "device on wrong root bus": (_add_root_child({"bdf": "0000:07:00.0", "model": "gpu"}),
                                 "sit on its bus 0000:00"),
    "bad bdf": (_set(*GPU, "bdf", value="0000:01:00"), "not a PCI bus id"),
    "unknown device model": (_set(*GPU, "model", value="tpu"), "no model named 'tpu'"),
    "endpoint with children": (_set(*GPU, "children", value=[]), "only bridges have children"),
    "children on two buses": (_set(*GPU, "bdf", value="0000:02:00.0"), "share one bus"),
    "child bus not above bridge": (_set(*PORT, "children", value=[{"bdf": "0000:00:02.0", "model": "gpu"}]),
                                   "greater than its own"),
    "duplicate bdf": (_add_child({"bdf": "0000:01:00.0", "model": "gpu"}), "used twice"),
    "vf collides with sibling": (_add_child({"bdf": "0000:01:01.2", "model": "gpu"}), "used twice"),
    "too many vfs": (_set(*NIC, "vfs", value=5), "allows 0..4 VFs"),
    "vfs on gpu": (_set(*GPU, "vfs", value=1), "allows 0..0 VFs"),
    "netdev missing": (_drop(*NIC, "netdev"), "netdev is required"),
    "netdev on gpu": (_set(*GPU, "netdev", value="eth0"), "netdev is required"),
    "netdev too long": (_set(*NIC, "netdev", value="ibp1s1averylongname"), "not a valid interface name"),
    "duplicate netdev": (_add_child({"bdf": "0000:01:02.0", "model": "nic", "netdev": "ibp1s1v1"}),
                         "used twice"),
    "uuid on nic": (_set(*NIC, "uuid", value="GPU-x"), "only GPUs have a UUID"),
    "link_up not bool": (_set(*NIC, "link_up", value=1), "link_up"),
    "overlapping root complexes": (_second_root({"root": "pci0000:01", "numa_node": 0, "children": []}),
                                   "overlaps"),
    "overlapping sibling bridges": (
        _add_root_child({"bdf": "0000:00:02.0", "model": "port",
                         "children": [{"bdf": "0000:01:05.0", "model": "gpu"}]}),
        "overlaps"),
    "missing topology xml": (_set("topology_xml", value="nope.xml"), "no such file"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_profiles_fail_with_a_located_message(tmp_path: Path, case: str) -> None:
    mutate, expected = BROKEN[case]
    data = copy.deepcopy(_MINIMAL)
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile_file(path, expect_name="tiny")
    assert str(path) in str(info.value)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_sibling_bus_ranges_must_not_interleave(tmp_path: Path) -> None:
    data = copy.deepcopy(_MINIMAL)
    port = _port(data)
    port["children"] = [
        {"bdf": "0000:01:00.0", "model": "port", "children": [
            {"bdf": "0000:02:00.0", "model": "port", "children": [{"bdf": "0000:05:00.0", "model": "gpu"}]}]},
        {"bdf": "0000:01:01.0", "model": "port", "children": [{"bdf": "0000:04:00.0", "model": "gpu"}]},
    ]
    with pytest.raises(ProfileError, match="overlaps"):
        load_profile_file(_write(tmp_path, data))


@pytest.mark.parametrize("text", ["{", "[]", '"x"', ""])
def test_unparsable_or_wrong_shape_files_are_profile_errors(tmp_path: Path, text: str) -> None:
    with pytest.raises(ProfileError, match=r"tiny\.json"):
        load_profile_file(_write(tmp_path, text))


def test_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile_file(tmp_path / "absent.json")
