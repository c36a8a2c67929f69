"""GPU-NIC locality on the four shapes (issue 43), through `topology --json` on written sysfs trees.

Trees are the simulated profiles written with the real writer, then edited the way a real host can differ
(crossed VPD, garbage VPD, a DMA function with a network class, an x86 root port): the reader sees files only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import cli
from agent.simulate.node import build_simulated_node
from agent.topology.locality import VpdError, vpd_image, vpd_keywords

# Per profile: GPU bus id -> (path, group, the RDMA PF(s) of that group)
SHAPES = {
    "dgx-h100": {
        "0000:1b:00.0": ("pcie-switch", "sw:0000:13:00.0", {"0000:18:00.0"}),
    },
    "hgx-b300-cx8": {
        f"0000:{bus:02x}:00.0": ("pcie-switch", f"sw:0000:{bus - 5:02x}:00.0", {f"0000:{bus - 3:02x}:00.0"})
        for bus in (0x16, 0x26, 0x36, 0x46, 0x96, 0xa6, 0xb6, 0xc6)
    },
    # NVIDIA's GB-CX8 GPUDirect guide: NIC 0000:03:00.0 <-> GPU 0009:06:00.0 <-> DMA 0009:03:00.0 (segments cross)
    "gb300-cx8": {
        "0009:06:00.0": ("data-direct", "sw:0009:01:00.0", {"0000:03:00.0"}),
        "0008:06:00.0": ("data-direct", "sw:0008:01:00.0", {"0002:03:00.0"}),
        "0019:06:00.0": ("data-direct", "sw:0019:01:00.0", {"0010:03:00.0"}),
        "0018:06:00.0": ("data-direct", "sw:0018:01:00.0", {"0012:03:00.0"}),
    },
    "gb200-cx7": {
        "0008:01:00.0": ("c2c", "numa:0", {"0000:01:00.0", "0002:01:00.0"}),
        "0009:01:00.0": ("c2c", "numa:0", {"0000:01:00.0", "0002:01:00.0"}),
        "0018:01:00.0": ("c2c", "numa:1", {"0010:01:00.0", "0012:01:00.0"}),
        "0019:01:00.0": ("c2c", "numa:1", {"0010:01:00.0", "0012:01:00.0"}),
    },
}
CLOSE = {"PIX", "PXB", "P2C"}


def _doc(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    return _run(capsys, *args)[0]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict, str]:
    assert cli.main(["topology", "--json", *args]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def _tree(tmp_path: Path, profile: str) -> Path:
    return build_simulated_node(profile, tmp_path / "node").sysfs_root


@pytest.mark.parametrize("profile", sorted(SHAPES))
def test_every_gpu_and_nic_gets_the_path_and_group_of_its_shape(capsys, profile):
    doc = _doc(capsys, "--simulate", profile)
    gpus = {g["pci"]: g for g in doc["gpus"]}
    nics = {n["pci"]: n for n in doc["nics"]}
    gpu_numa = {g["pci"]: g["numa"] for g in doc["gpus"]}
    for bus_id, (path, group, members) in SHAPES[profile].items():
        assert (gpus[bus_id]["gpu_direct_path"], gpus[bus_id]["gpu_direct_group"]) == (path, group)
        in_group = {pci for pci, nic in nics.items() if nic["gpu_direct_group"] == group}
        assert in_group == members
        assert all(nics[pci]["gpu_direct_path"] == path for pci in members)
    # what must be right: a GPU and its group's NICs close, pairs across sockets SYS
    for gpu in doc["gpus"]:
        for pci, level in doc["links"][gpu["pci"]].items():
            if nics[pci]["gpu_direct_group"] == gpu["gpu_direct_group"]:
                assert level in CLOSE, (gpu["pci"], pci, level)
            if nics[pci]["numa"] != gpu_numa[gpu["pci"]]:
                assert level == "SYS", (gpu["pci"], pci, level)


def test_data_direct_nics_name_their_dma_function_and_keep_their_own_root(capsys):
    doc = _doc(capsys, "--simulate", "gb300-cx8")
    nics = {n["pci"]: n for n in doc["nics"]}
    assert nics["0000:03:00.0"]["data_direct_function"] == "0009:03:00.0"
    assert nics["0000:03:00.0"]["pcie_root"] == "pci0000:00"  # its identity stays its own
    assert doc["links"]["0009:06:00.0"]["0000:03:00.0"] == "PXB"  # NCCL's path through the `_dma` device
    assert not any(n["pci"].endswith(":03:00.0") and n["pci"][:4] in ("0008", "0009", "0018", "0019")
                   for n in doc["nics"])  # the DMA function is not a NIC
    switch = _doc(capsys, "--simulate", "hgx-b300-cx8")
    assert all(n["data_direct_function"] is None for n in switch["nics"])


def _set_v3(root: Path, bdf: str, v3: str) -> None:
    vpd = root / "bus" / "pci" / "devices" / bdf / "vpd"
    keywords = {k: v.decode() for k, v in vpd_keywords(vpd.read_bytes()).items()}
    vpd.write_bytes(vpd_image("NVIDIA ConnectX-8 SuperNIC", {**keywords, "V3": v3}))


def test_pairing_goes_by_vpd_v3_never_by_bus_order(tmp_path, capsys):
    root = _tree(tmp_path, "gb300-cx8")
    # rotate the DMA functions' ASIC ids within each socket: now NIC 0000 pairs with DMA 0008, 0002 with 0009
    a = vpd_keywords((root / "bus/pci/devices/0000:03:00.0/vpd").read_bytes())["V3"].decode()
    b = vpd_keywords((root / "bus/pci/devices/0002:03:00.0/vpd").read_bytes())["V3"].decode()
    _set_v3(root, "0008:03:00.0", a)
    _set_v3(root, "0009:03:00.0", b)
    doc = _doc(capsys, "--sysfs-root", str(root))
    nics = {n["pci"]: n for n in doc["nics"]}
    assert nics["0000:03:00.0"]["data_direct_function"] == "0008:03:00.0"
    assert nics["0002:03:00.0"]["data_direct_function"] == "0009:03:00.0"
    assert nics["0000:03:00.0"]["gpu_direct_group"] == "sw:0008:01:00.0"
    assert doc["links"]["0008:06:00.0"]["0000:03:00.0"] == "PXB"
    # the other socket keeps the guide's crossed pairing: 0010 <-> 0019, which bus order would get wrong
    assert nics["0010:03:00.0"]["data_direct_function"] == "0019:03:00.0"


def test_a_dma_function_is_found_by_its_ids_whatever_its_class(tmp_path, capsys):
    root = _tree(tmp_path, "gb300-cx8")
    (root / "bus/pci/devices/0009:03:00.0/class").write_text("0x020700\n")  # claims to be an IB controller
    doc = _doc(capsys, "--sysfs-root", str(root))
    assert "0009:03:00.0" not in {n["pci"] for n in doc["nics"]}
    assert {n["pci"]: n for n in doc["nics"]}["0000:03:00.0"]["data_direct_function"] == "0009:03:00.0"


@pytest.mark.parametrize("damage", ["checksum", "truncated", "directory"])
def test_unreadable_vpd_falls_back_to_the_pcie_position_with_one_log_line(tmp_path, capsys, damage):
    root = _tree(tmp_path, "gb300-cx8")
    vpd = root / "bus/pci/devices/0009:03:00.0/vpd"
    good = vpd.read_bytes()
    vpd.unlink()
    if damage == "checksum":
        vpd.write_bytes(good[:-2] + bytes([(good[-2] + 1) & 0xFF]) + good[-1:])
    elif damage == "truncated":
        vpd.write_bytes(good[:10])
    else:
        vpd.mkdir()
    doc, err = _run(capsys, "--sysfs-root", str(root))
    nics = {n["pci"]: n for n in doc["nics"]}
    fallen = nics["0000:03:00.0"]
    assert fallen["data_direct_function"] is None
    # its own position: a ConnectX PF under a Grace root port, grouped with the GPUs of its socket by NUMA node
    assert (fallen["gpu_direct_path"], fallen["gpu_direct_group"]) == ("c2c", "numa:0")
    assert doc["links"]["0009:06:00.0"]["0000:03:00.0"] == "P2C"
    assert nics["0002:03:00.0"]["data_direct_function"] == "0008:03:00.0"  # the others are untouched
    lines = [line for line in err.splitlines() if "0009:03:00.0" in line and "vpd" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], err


def test_vfs_follow_the_dma_function_unless_switched_off(tmp_path, capsys):
    root = _tree(tmp_path, "gb300-cx8")
    on = _doc(capsys, "--sysfs-root", str(root))
    off = _doc(capsys, "--sysfs-root", str(root), "--no-data-direct-vfs")
    pf_on = {n["pci"]: n for n in on["nics"]}["0000:03:00.0"]
    pf_off = {n["pci"]: n for n in off["nics"]}["0000:03:00.0"]
    # the PF itself is placed at its DMA function either way; its VFs only when Data Direct is on for them
    assert pf_on["gpu_direct_group"] == pf_off["gpu_direct_group"] == "sw:0009:01:00.0"
    from agent.topology.load import load_topology
    vfs_on = load_topology(root, {}).find("0000:03:00.1")
    vfs_off = load_topology(root, {}, data_direct_vfs=False).find("0000:03:00.1")
    assert (vfs_on.gpu_direct_path, vfs_on.gpu_direct_group) == ("data-direct", "sw:0009:01:00.0")
    assert (vfs_off.gpu_direct_path, vfs_off.gpu_direct_group) == ("c2c", "numa:0")


def test_bluefield_and_x86_root_ports_are_not_c2c(tmp_path, capsys):
    doc = _doc(capsys, "--simulate", "gb200-cx7")
    bf3 = {n["pci"]: n for n in doc["nics"]}["0001:01:00.0"]
    assert bf3["gpu_direct_group"] is None and doc["links"]["0008:01:00.0"]["0001:01:00.0"] == "NODE"
    root = _tree(tmp_path, "gb200-cx7")
    for port in root.glob("devices/pci*/*:00:00.0"):  # the same tree behind x86 root ports
        (port / "vendor").write_text("0x8086\n")
        (port / "device").write_text("0x352a\n")
    x86 = _doc(capsys, "--sysfs-root", str(root))
    assert all(g["gpu_direct_group"] is None and g["gpu_direct_path"] is None for g in x86["gpus"])
    assert all(n["gpu_direct_group"] is None for n in x86["nics"])
    assert x86["links"]["0008:01:00.0"]["0000:01:00.0"] == "NODE"


def test_the_matrix_shows_p2c_and_the_groups(capsys):
    assert cli.main(["topology", "--simulate", "gb200-cx7"]) == 0
    out = capsys.readouterr().out
    assert "P2C  =" in out and "path c2c group numa:0" in out


def test_vpd_round_trip_and_damage():
    image = vpd_image("board", {"PN": "900", "SN": "MT1", "V3": "abc"})
    assert vpd_keywords(image) == {"PN": b"900", "SN": b"MT1", "V3": b"abc"}
    for bad in (image[:5], image[:-3] + b"\x00" + image[-2:], b"\x82\x01\x00x\x78", b"\x90\xff\xff"):
        with pytest.raises(VpdError):
            vpd_keywords(bad)


def _pci_spec_sample_vpd() -> bytes:
    """The sample VPD of the PCI Local Bus Specification, Rev. 3.0, Appendix I ("VPD Example"), byte for byte:
    identifier string, VPD-R (PN, EC, SN, MN, then RV padding to offset 128), VPD-W (V1, Y1, RW), end tag at 255.
    The spec prints "Checksum" for RV's first byte; it is computed here as the spec defines it."""
    image = bytearray(
        b"\x82" + (0x21).to_bytes(2, "little") + b"ABCD Super-Fast Widget Controller"
        + b"\x90" + (0x59).to_bytes(2, "little")
        + b"PN\x08" + b"6181682A" + b"EC\x0a" + b"4950262536" + b"SN\x08" + b"00000194" + b"MN\x04" + b"1037"
        + b"RV\x2c" + b"\x00" * 0x2C
        + b"\x91" + (0x7C).to_bytes(2, "little")
        + b"V1\x05" + b"65A01" + b"Y1\x0d" + b"Error Code 26" + b"RW\x61" + b"\x00" * 0x61
        + b"\x78")
    assert len(image) == 256 and image[36] == 0x90 and image[81:83] == b"RV" and image[128] == 0x91
    image[84] = -sum(image[:84]) & 0xFF
    return bytes(image)


def test_vpd_parser_reads_the_pci_spec_sample():
    """The parser meets a layout it did not write: the spec's own sample, VPD-W and all."""
    image = _pci_spec_sample_vpd()
    assert vpd_keywords(image) == {"PN": b"6181682A", "EC": b"4950262536", "SN": b"00000194", "MN": b"1037"}
    with pytest.raises(VpdError):
        vpd_keywords(image[:84] + bytes([(image[84] + 1) & 0xFF]) + image[85:])


def test_doctor_warns_about_an_unreadable_vpd(tmp_path, capsys):
    root = _tree(tmp_path, "gb300-cx8")
    assert cli.main(["doctor", "--sysfs-root", str(root), "--json"]) in (0, 1)
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert rows["sysfs.locality"]["status"] == "ok"
    assert "data-direct 4" in rows["sysfs.locality"]["detail"]
    (root / "bus/pci/devices/0018:03:00.0/vpd").write_bytes(b"\x82\xff\xff")
    assert cli.main(["doctor", "--sysfs-root", str(root), "--json"]) in (0, 1)
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert rows["sysfs.locality"]["status"] == "warn"
    assert "0018:03:00.0/vpd" in rows["sysfs.locality"]["detail"] and rows["sysfs.locality"]["fix"]


@pytest.mark.parametrize("kind", ["fifo", "huge"])
def test_a_hostile_vpd_neither_blocks_nor_floods_the_scan(tmp_path, capsys, kind):
    """A FIFO planted as `vpd` is refused without blocking; a 1 GiB sparse one is read up to the 32 KiB VPD limit."""
    import os
    import time
    root = _tree(tmp_path, "gb300-cx8")
    vpd = root / "bus/pci/devices/0009:03:00.0/vpd"
    vpd.unlink()
    if kind == "fifo":
        os.mkfifo(vpd)
    else:
        with open(vpd, "wb") as f:
            f.truncate(1 << 30)
    start = time.monotonic()
    doc, err = _run(capsys, "--sysfs-root", str(root))
    assert time.monotonic() - start < 5
    assert {n["pci"]: n for n in doc["nics"]}["0000:03:00.0"]["data_direct_function"] is None
    assert sum("0009:03:00.0" in line and "vpd" in line for line in err.splitlines()) == 1
